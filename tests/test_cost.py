"""The roofline cost model against numbers worked out by hand, and `quill cost` as run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.contract.plan import SeqPlan, StepPlan
from quill.cost import BatchShape, CostModel, HardwareSpec, ModelSpec
from quill.cost.cli import add_cost_parser, main
from quill.cost.model import PRESETS

# 1e9 parameters of 2 bytes on a device of 1e12 FLOP/s and 1e11 B/s: small round numbers.
ABSTRACT = ModelSpec.abstract(1e9, 2)
SLOW = HardwareSpec("slow", {"bfloat16": 1e12}, memory_bandwidth=1e11, memory_capacity=80e9)
SMOL = ModelSpec.preset("SmolLM2-135M")


# -- the abstract model: weights only --------------------------------------------------------
def test_one_decode_of_an_abstract_model_is_movement_bound():
    cost = CostModel(ABSTRACT, SLOW).price(BatchShape.abstract(decode=[0]))
    assert cost.flops == 2e9  # 2 FLOPs per weight
    assert cost.bytes_moved == 2e9  # every weight read once
    assert cost.arithmetic_s == pytest.approx(2e-3, rel=1e-12)  # 2e9 / 1e12
    assert cost.movement_s == pytest.approx(2e-2, rel=1e-12)  # 2e9 / 1e11
    assert cost.bound == "movement"
    assert cost.roofline_s == pytest.approx(0.02, rel=1e-12)
    assert cost.predicted_s == pytest.approx(0.02, rel=1e-12)
    assert cost.communication_s == 0 and cost.kv_read_bytes == 0 and cost.activation_bytes == 0


@pytest.mark.parametrize("tokens", [1, 7, 128, 4096])
def test_a_prompt_of_l_tokens_does_l_ops_per_byte(tokens):
    cost = CostModel(ABSTRACT, SLOW).price(BatchShape.abstract(prefill=[(tokens, 0)]))
    assert cost.ops_per_byte == tokens
    assert cost.bytes_moved == 2e9  # the same movement however many tokens share the weights


@pytest.mark.parametrize("batch", [1, 2, 50, 1000])
def test_a_batch_of_b_decodes_does_b_ops_per_byte(batch):
    cost = CostModel(ABSTRACT, SLOW).price(BatchShape.abstract(decode=[100] * batch))
    assert cost.ops_per_byte == batch
    # The ridge of this device is 1e12 / 1e11 = 10 ops/byte.
    assert cost.bound == ("arithmetic" if batch > 10 else "movement")


def test_step_overhead_is_added_to_the_floor():
    hw = dataclasses.replace(SLOW, step_overhead_s=0.005)
    cost = CostModel(ABSTRACT, hw).price(BatchShape.decodes(1, 0))
    assert cost.roofline_s == pytest.approx(0.02, rel=1e-12)
    assert cost.predicted_s == pytest.approx(0.025, rel=1e-12)


# -- a concrete model -----------------------------------------------------------------------
PRESET_PARAMS = {
    "Llama-3-8B": 8_030_261_248,
    "Llama-3-70B": 70_553_706_496,
    "Mistral-7B": 7_241_732_096,
    "Qwen2-7B": 7_615_616_512,
    "SmolLM2-135M": 134_515_008,
}


@pytest.mark.parametrize("name", list(PRESET_PARAMS))
def test_preset_parameter_counts_are_the_published_ones(name):
    assert ModelSpec.preset(name).num_params == PRESET_PARAMS[name]
    assert ModelSpec.resolve(name.lower()).num_params == PRESET_PARAMS[name]


def test_smollm2_shape_by_hand():
    # Per layer: q 576*576 + k, v 576*192 each + o 576*576 + gate, up, down 576*1536 each
    # + 2 norms of 576 = 3,540,096; 30 layers + tied embedding 49152*576 + final norm 576.
    assert 30 * 3_540_096 + 49_152 * 576 + 576 == 134_515_008
    assert SMOL.num_params == 134_515_008
    assert SMOL.weight_bytes == 269_030_016  # tied: the embedding is the lm_head, read whole
    assert SMOL.kv_bytes_per_token == 23_040  # 2 (K, V) * 30 layers * 3 heads * 64 * 2 B
    assert SMOL.dtype == "bfloat16"
    untied = ModelSpec.preset("Llama-3-8B")
    assert untied.weight_bytes == (8_030_261_248 - 128_256 * 4096) * 2  # input table not read


def test_attention_pairs_are_causal():
    # 10 tokens after 5 cached: token i (1..10) attends to 5 + i keys.
    chunk = BatchShape.from_seqs([(5, 10, True, False)])
    assert chunk.attention_pairs == 5 * 10 + 55 == sum(5 + i for i in range(1, 11))
    assert chunk.kv_tokens_read == 15 and chunk.kv_tokens_written == 10
    both = BatchShape.abstract(prefill=[(10, 5)], decode=[20, 30])
    assert both.num_tokens == 12 and both.num_seqs == 3 and both.num_sampled == 3
    assert both.num_prefill_tokens == 10 and both.num_decode_tokens == 2
    assert both.attention_pairs == 105 + 21 + 31
    assert both.kv_tokens_read == 15 + 21 + 31


def test_smollm2_prefill_by_hand():
    cost = CostModel(SMOL, SLOW).price(BatchShape.prefills(1, 100))
    # Matmul weights per layer: 2*576*576 + 2*576*192 + 3*576*1536 = 3,538,944; 30 layers.
    # 2 FLOPs each for 100 tokens, plus the lm_head (576 x 49152) for the one sampled row.
    assert cost.linear_flops == 2 * 106_168_320 * 100 + 2 * 576 * 49_152 == 21_290_287_104
    # 100*101/2 = 5050 pairs; 4 FLOPs per pair per head dim: 4 * 30 layers * 9 heads * 64.
    assert cost.attention_flops == 4 * 30 * 9 * 64 * 5050 == 349_056_000
    assert cost.kv_read_bytes == 100 * 23_040 and cost.kv_write_bytes == 100 * 23_040
    # Activations: per token 30 * (14*576 + 4*576 + 2*192 + 6*1536) + 4*576 = 601,344
    # elements, per sampled row 576 + 49152; 2 bytes each.
    assert cost.activation_bytes == 2 * (601_344 * 100 + 49_728)
    assert cost.weight_bytes == 269_030_016
    assert cost.arithmetic_s == pytest.approx(21_639_343_104 / 1e12)
    moved = 269_030_016 + 2 * 2_304_000 + 2 * (601_344 * 100 + 49_728)
    assert cost.movement_s == pytest.approx(moved / 1e11)


def test_tensor_parallel_halves_weights_and_pays_all_reduces():
    llama = ModelSpec.preset("Llama-3-8B")
    h100 = HardwareSpec.preset("H100-SXM")
    one = CostModel(llama, h100).price(BatchShape.decodes(10, 99))
    two = CostModel(llama, h100, tp=2).price(BatchShape.decodes(10, 99))
    assert two.weight_bytes == one.weight_bytes / 2 == 7_504_924_672
    assert two.linear_flops == one.linear_flops / 2
    assert two.kv_read_bytes == one.kv_read_bytes / 2
    # 2 all-reduces per layer of 10 tokens * 4096 * 2 B: 32 * 2 * 81,920 = 5,242,880 B;
    # a ring sends 2*(2-1)/2 = 1 times that from each device over 900 GB/s.
    assert one.comm_bytes == 0 and one.communication_s == 0
    assert two.comm_bytes == 5_242_880
    assert two.communication_s == pytest.approx(5_242_880 / 900e9)
    assert two.roofline_s == pytest.approx(
        max(two.arithmetic_s, two.movement_s) + 5_242_880 / 900e9
    )
    four = CostModel(ModelSpec.preset("Llama-3-70B"), h100, tp=4).price(BatchShape.decodes(1, 0))
    assert four.comm_bytes == 2 * 80 * 8192 * 2 * 2 * 3 / 4  # ring factor 2*(4-1)/4


def test_tensor_parallel_refusals():
    llama = ModelSpec.preset("Llama-3-8B")
    with pytest.raises(ValueError, match="its 32 query heads do not divide among 3 ranks"):
        CostModel(llama, HardwareSpec.preset("H100"), tp=3)
    with pytest.raises(ValueError, match="interconnect bandwidth"):
        CostModel(llama, SLOW, tp=2)
    with pytest.raises(ValueError, match="architecture"):
        CostModel(ABSTRACT, HardwareSpec.preset("H100"), tp=2)
    with pytest.raises(ValueError, match="tp must be"):
        CostModel(llama, SLOW, tp=0)


def test_ranks_on_one_host_share_it_and_pay_the_measured_all_reduces():
    """SmolLM2-135M at tp=3 on a host whose 3-rank all-reduce measured 100 us + bytes at
    1 GB/s: the ranks split the work and the host's rates alike, so compute and movement are
    the one-rank figures; each of the 2 x 30 all-reduces of a pass carries num_tokens x 576
    bf16 values (2 bytes each). A decode of 4: 60 x 100 us + 60 x 4 x 576 x 2 B / 1 GB/s."""
    host = dataclasses.replace(
        SLOW, host_allreduce={"3": {"latency_s": 1e-4, "bandwidth": 1e9, "points": []}}
    )
    one = CostModel(SMOL, host).price(BatchShape.decodes(4, 99))
    three = CostModel(SMOL, host, tp=3).price(BatchShape.decodes(4, 99))
    assert three.arithmetic_s == pytest.approx(one.arithmetic_s)
    assert three.movement_s == pytest.approx(one.movement_s)
    assert three.communication_s == pytest.approx(60 * 1e-4 + 60 * 4 * 576 * 2 / 1e9)
    assert three.predicted_s == pytest.approx(one.predicted_s + 0.006 + 0.00027648)
    with pytest.raises(ValueError, match="measured all-reduce of 2 ranks"):
        CostModel(ModelSpec.preset("Llama-3-8B"), host, tp=2)  # measured for 3 ranks only
    with pytest.raises(ValueError, match="host_allreduce keys"):
        dataclasses.replace(SLOW, host_allreduce={"1": {"latency_s": 0, "bandwidth": 1}})


CALIBRATION = {
    "overhead_s": 1e-3,
    "per_seq_s": 1e-5,
    "s_per_weight_byte": 1e-12,
    "s_per_linear_flop": 1e-15,
    "s_per_attention_flop": 2e-15,
    "s_per_kv_byte": 3e-12,
    "r2": 0.99,  # informational, ignored
}


def test_calibrated_prediction_is_the_additive_formula():
    hw = dataclasses.replace(SLOW, calibration=CALIBRATION)
    cost = CostModel(SMOL, hw).price(BatchShape.decodes(4, 99))
    # 4 decodes at context 100: 400 pairs, 400 tokens of KV read and 4 written.
    linear = 2 * 106_168_320 * 4 + 2 * 576 * 49_152 * 4  # = 1,075,838,976
    attention = 4 * 30 * 9 * 64 * 400  # = 27,648,000
    kv = (400 + 4) * 23_040  # = 9,308,160
    expected = (
        1e-3 + 4 * 1e-5 + 269_030_016 * 1e-12 + linear * 1e-15 + attention * 2e-15 + kv * 3e-12
    )
    assert expected == pytest.approx(0.00133808563097600, rel=1e-12)
    assert cost.predicted_s == pytest.approx(expected, rel=1e-12)
    assert cost.roofline_s == max(cost.arithmetic_s, cost.movement_s)  # still reported


def test_calibration_is_validated():
    with pytest.raises(ValueError, match="missing s_per_kv_byte"):
        dataclasses.replace(SLOW, calibration={k: 0 for k in list(CALIBRATION)[:5]})
    with pytest.raises(ValueError, match="per_seq_s must be >= 0"):
        dataclasses.replace(SLOW, calibration={**CALIBRATION, "per_seq_s": -1})


# -- model specs from files ----------------------------------------------------------------
def _shape(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, name="")


def test_spec_from_the_default_models_config_json_is_the_preset(model_dir):
    assert _shape(ModelSpec.from_path(model_dir)) == _shape(SMOL)
    assert _shape(ModelSpec.resolve(str(model_dir / "config.json"))) == _shape(SMOL)


def test_spec_from_the_default_models_gguf_is_the_preset():
    from quill.model.default_model import default_gguf_path

    spec = ModelSpec.from_path(default_gguf_path())
    assert _shape(dataclasses.replace(spec, bytes_per_param=2)) == _shape(SMOL)
    # Its bytes as quill serves it: the layers' Q4_1 blocks as int4 (20 bytes a block of 32),
    # the tied table's Q8_0 as the int8 head (34), the norms at 2. By hand: 30 layers of
    # 2 x 576^2 (q, o) + 2 x 576 x 192 (k, v) + 3 x 576 x 1536 (gate, up, down) = 106,168,320
    # weights, the table 49,152 x 576 = 28,311,552, the norms 576 x 61 = 35,136.
    layers, table, norms = 106_168_320, 28_311_552, 35_136
    assert spec.num_params == layers + table + norms
    want = (layers * 20 / 32 + table * 34 / 32 + norms * 2) / spec.num_params
    assert spec.bytes_per_param == pytest.approx(want, rel=1e-12)  # 0.717


def test_gguf_loader_still_exports_the_metadata_readers():
    from quill.model import gguf_config, gguf_loader

    assert gguf_loader.gguf_hf_config is gguf_config.gguf_hf_config
    assert gguf_loader.open_gguf is gguf_config.open_gguf


def test_model_spec_validation(tmp_path):
    config = {**PRESETS["SmolLM2-135M"]}
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model config lacks 'hidden_size'"):
        ModelSpec.from_path(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelSpec.from_hf_config({**PRESETS["SmolLM2-135M"], "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="num_params must be positive"):
        ModelSpec.abstract(0, 2)
    with pytest.raises(ValueError, match="bytes_per_param must be positive"):
        ModelSpec.abstract(1e9, 0)
    with pytest.raises(ValueError, match="unknown model 'nope'.*SmolLM2-135M"):
        ModelSpec.resolve("nope")
    assert ModelSpec.abstract(1e9, 4).dtype == "float32"
    assert ModelSpec.abstract(1e9, 1).dtype == "int8"
    assert ModelSpec.preset("Llama-3-8B", bytes_per_param=1).weight_bytes == 7_504_924_672


# -- hardware ------------------------------------------------------------------------------
def test_hardware_presets_and_json_round_trip(tmp_path):
    h100 = HardwareSpec.resolve("h100-sxm")
    assert h100.flops_for("bf16") == 989e12 and h100.memory_bandwidth == 3.35e12
    assert HardwareSpec.resolve("H200").memory_capacity == 141e9
    assert HardwareSpec.resolve("a100").flops_for("float32") == 19.5e12
    assert HardwareSpec.resolve("L40S").interconnect_bandwidth == 64e9
    spec = dataclasses.replace(h100, name="mine", price_per_hour=2.5, calibration=CALIBRATION)
    spec.save(tmp_path / "mine.json")
    assert HardwareSpec.resolve(str(tmp_path / "mine.json")) == spec


def test_hardware_validation():
    with pytest.raises(ValueError, match="memory_bandwidth must be positive, got 0"):
        HardwareSpec("x", {"bfloat16": 1e12}, memory_bandwidth=0, memory_capacity=1e9)
    with pytest.raises(ValueError, match="flops\\['float16'\\] must be positive"):
        HardwareSpec("x", {"fp16": -1}, memory_bandwidth=1e9, memory_capacity=1e9)
    with pytest.raises(ValueError, match="memory_capacity must be finite"):
        HardwareSpec("x", {"bfloat16": 1e12}, memory_bandwidth=1e9, memory_capacity=float("nan"))
    with pytest.raises(ValueError, match="no peak FLOP/s for 'int8'; it lists bfloat16"):
        SLOW.flops_for("int8")
    with pytest.raises(ValueError, match="unknown hardware 'tpu'.*H100-SXM"):
        HardwareSpec.resolve("tpu")


def test_kv_capacity_by_hand():
    cm = CostModel(SMOL, HardwareSpec.preset("H100"))
    # 90% of 80 GB less 269,030,016 B of weights, in 23,040 B tokens.
    assert cm.kv_capacity_tokens() == (72_000_000_000 - 269_030_016) // 23_040 == 3_113_323
    assert cm.max_batch(1000) == 3113
    assert cm.max_batch(1000, limit=1024) == 1024
    with pytest.raises(ValueError, match="does not fit in 43.2 GB"):
        CostModel(ModelSpec.preset("Llama-3-70B"), HardwareSpec.preset("L40S")).kv_capacity_tokens()


# -- the engine's plans --------------------------------------------------------------------
def _plan(seqs):
    return types.SimpleNamespace(
        seqs=[
            types.SimpleNamespace(
                start=s, num_tokens=n, samples=smp, is_decode=d, draft_token_ids=None
            )
            for s, n, smp, d in seqs
        ]
    )


def test_from_plan_agrees_with_from_seqs_and_price_accepts_plans():
    seqs = [(0, 64, False, False), (64, 30, True, False), (500, 1, True, True), (9, 1, True, True)]
    assert BatchShape.from_plan(_plan(seqs)) == BatchShape.from_seqs(seqs)
    assert BatchShape.prefills(3, 10, 5) == BatchShape.abstract(prefill=[(10, 5)] * 3)
    assert BatchShape.decodes(4, 7) == BatchShape.abstract(decode=[7] * 4)
    cm = CostModel(SMOL, SLOW)
    assert cm.price(_plan(seqs)) == cm.price(BatchShape.from_seqs(seqs))
    assert cm.price(_plan([])).predicted_s == 0
    # A decode with 3 drafts: 4 tokens, each with its row of logits, all decode work.
    drafted = types.SimpleNamespace(
        start=500, num_tokens=4, samples=True, is_decode=True, draft_token_ids=[1, 2, 3]
    )
    shape = BatchShape.from_plan(types.SimpleNamespace(seqs=[drafted]))
    assert shape == BatchShape.from_seqs([(500, 4, 4, True)])
    assert (shape.num_sampled, shape.num_decode_tokens, shape.attention_pairs) == (4, 4, 2010)
    # A prompt chunk scoring its rows (prompt logprobs): positions 0..29 of a 40-token prompt
    # give the logprobs of tokens 1..30, so 30 rows of logits though it samples nothing.
    scoring = types.SimpleNamespace(
        start=0,
        num_tokens=30,
        samples=False,
        is_decode=False,
        draft_token_ids=None,
        prompt_logprob_token_ids=list(range(1, 31)),
    )
    shape = BatchShape.from_plan(types.SimpleNamespace(seqs=[scoring]))
    assert shape == BatchShape.from_seqs([(0, 30, 30, False)])
    assert shape.num_sampled == 30
    # Each row is the output head's product: 2 x 576 x 49,152 FLOPs more than the chunk's own.
    plain = BatchShape.from_seqs([(0, 30, 0, False)])
    assert SMOL.linear_flops(30, 30) - SMOL.linear_flops(30, 0) == 30 * 2 * 576 * 49_152
    assert cm.price(shape).flops - cm.price(plain).flops == 30 * 2 * 576 * 49_152


# -- the command ---------------------------------------------------------------------------
ABSTRACT_FLAGS = ["--params", "1e9", "--flops", "1e12", "--bandwidth", "1e11"]


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_json_has_the_rows_and_hand_worked_times(capsys):
    argv = [*ABSTRACT_FLAGS, "--prompt-tokens", "100", "--output-tokens", "10", "--batch", "1,4"]
    rc, out, _ = _run(capsys, [*argv, "--json"])
    assert rc == 0
    rows = json.loads(out)["rows"]
    assert [(r["phase"], r["batch"]) for r in rows] == [
        ("prefill", 1),
        ("decode", 1),
        ("prefill", 4),
        ("decode", 4),
    ]
    for r in rows:
        assert {"phase", "tokens", "batch", "passes", "arithmetic_s", "movement_s"} <= set(r)
        assert {"bound", "time_s", "ttft_s", "itl_s"} <= set(r)
    prefill, decode = rows[0], rows[1]
    # 100 tokens: 2e11 FLOPs in 0.2 s against 2e9 B in 0.02 s.
    assert prefill["passes"] == 1 and prefill["bound"] == "arithmetic"
    assert prefill["time_s"] == pytest.approx(0.2) and prefill["ttft_s"] == pytest.approx(0.2)
    # 10 replies: 10 passes of 0.02 s each.
    assert decode["passes"] == 10 and decode["bound"] == "movement"
    assert decode["time_s"] == pytest.approx(0.2) and decode["itl_s"] == pytest.approx(0.02)
    assert rows[3]["ops_per_byte"] == pytest.approx(4)


def test_cli_prices_a_million_tokens_quiet_and_busy(capsys):
    argv = [*ABSTRACT_FLAGS, "--prompt-tokens", "100", "--output-tokens", "10"]
    rc, out, _ = _run(capsys, [*argv, "--price-per-hour", "3.6", "--json"])
    assert rc == 0
    quiet, busy = json.loads(out)["costs"]
    # $3.6/h is $0.001/s. Quiet: a reply token takes 0.02 s ($20 per million), a prompt token
    # 0.2 s / 100 ($2 per million). Busy (1024, memory unlimited): a pass of 1024 decodes is
    # arithmetic-bound at 2.048 s, 2 ms a token, $2 per million.
    assert quiet["batch"] == 1 and busy["batch"] == 1024
    assert quiet["usd_per_million_output_tokens"] == pytest.approx(20)
    assert busy["usd_per_million_output_tokens"] == pytest.approx(2)
    assert quiet["usd_per_million_prompt_tokens"] == pytest.approx(2)
    assert busy["usd_per_million_prompt_tokens"] == pytest.approx(2)
    rc, out, _ = _run(capsys, [*argv, "--price-per-hour", "3.6"])
    assert "$/M reply tokens" in out and "busy" in out and "quiet" in out


def test_cli_table_reads_at_a_glance(capsys):
    argv = ["--model", "SmolLM2-135M", "--hardware", "H100", "--batch", "1,8"]
    rc, out, _ = _run(capsys, argv)
    assert rc == 0
    assert "SmolLM2-135M: 134,515,008 params" in out and "ridge 295.2 FLOP/B" in out
    header = next(line for line in out.splitlines() if line.startswith("prompt"))
    for column in ("phase", "tokens", "batch", "passes", "arithmetic ms", "movement ms"):
        assert column in header
    for column in ("bound", "time ms", "TTFT ms", "ITL ms"):
        assert column in header
    assert sum(line.split()[2] == "decode" for line in out.splitlines() if line[:1].isdigit()) == 2


def test_cli_kv_cache_dtype_sets_the_kv_bytes(capsys):
    """SmolLM2: 30 layers x (K, V) x 3 KV heads x 64 = 11,520 elements per token."""
    per_token = {}
    for dtype in ("auto", "float32", "float16"):
        argv = ["--model", "SmolLM2-135M", "--hardware", "H100", "--json"]
        rc, out, _ = _run(capsys, [*argv, "--bytes-per-param", "4", "--kv-cache-dtype", dtype])
        assert rc == 0
        doc = json.loads(out)
        per_token[dtype] = doc["model"]["kv_bytes_per_element"] * 11520
    assert per_token == {"auto": 23040, "float32": 46080, "float16": 23040}


def test_cli_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "roofline.png"
    rc, _, _ = _run(capsys, [*ABSTRACT_FLAGS, "--batch", "1,64", "--plot", str(path)])
    assert rc == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--flops", "1e12", "--bandwidth", "1e11"], "give a model"),
        (["--params", "1e9"], "give hardware"),
        ([*ABSTRACT_FLAGS, "--model", "SmolLM2-135M"], "not both"),
        (
            ["--params", "1e9", "--flops", "1e12", "--bandwidth", "0"],
            "--bandwidth must be positive",
        ),
        (["--params", "1e9", "--flops", "fast", "--bandwidth", "1e11"], "--flops expects a number"),
        (["--model", "Llama-3-70B", "--hardware", "L40S"], "does not fit"),
        (["--model", "Llama-3-8B", "--hardware", "H100", "--tp", "3"], "does not divide"),
        (["--model", "Llama-9", "--hardware", "H100"], "unknown model 'Llama-9'"),
        (["--model", "SmolLM2-135M", "--hardware", "tpu9"], "unknown hardware 'tpu9'"),
        ([*ABSTRACT_FLAGS, "--batch", "0"], "--batch expects a positive integer"),
        ([*ABSTRACT_FLAGS, "--prompt-tokens", "1,,2"], "--prompt-tokens expects"),
    ],
)
def test_cli_bad_input_is_one_clear_line_and_exit_2(capsys, argv, message):
    rc, out, err = _run(capsys, argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("quill cost: error: ") and message in err


def test_cli_unknown_flag_is_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([*ABSTRACT_FLAGS, "--frobnicate"])
    assert e.value.code == 2
    assert "--frobnicate" in capsys.readouterr().err


def _quill_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quill")
    add_cost_parser(parser.add_subparsers(dest="command"))
    return parser


def test_cost_registers_on_the_quill_parser(capsys):
    args = _quill_parser().parse_args(["cost", *ABSTRACT_FLAGS, "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["rows"]


def test_calibrate_gets_its_arguments_untouched(monkeypatch):
    seen = []
    fake = types.ModuleType("quill.cost.calibrate")
    fake.main = lambda rest: seen.append(rest) or 0
    monkeypatch.setitem(sys.modules, "quill.cost.calibrate", fake)
    args = _quill_parser().parse_args(["cost", "calibrate", "--model", "x", "-h", "--tp", "2"])
    assert args.func(args) == 0
    assert seen == [["--model", "x", "-h", "--tp", "2"]]


def test_the_cost_modules_do_not_import_torch():
    code = (
        "import sys, quill.cost, quill.cost.cli, quill.cost.step, quill.cost.table, "
        "quill.cost.model, quill.cost.hardware, quill.cost.batch, quill.model.gguf_config; "
        "from quill.cost.cli import main; "
        "main(['--model', 'SmolLM2-135M', '--hardware', 'H100', '--json']); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_products_of_few_rows_are_charged_their_measured_rate():
    """A CPU's GEMM runs 4 rows barely faster than 1: matmul_rates says how much slower."""
    model = ModelSpec.preset("SmolLM2-135M")
    rates = {"layers": [[1, 1e10], [16, 4e10]]}  # no lm_head curve: the layers' is used
    spec = HardwareSpec("cpu", {"bfloat16": 1e11}, 1e10, 8e9, matmul_rates=rates)
    cost = CostModel(model, spec)
    four = cost.price(BatchShape.decodes(4, 10))
    # log2(4) is halfway from log2(1) to log2(16): 2.5e10 FLOP/s, 1.6x slower than the best.
    assert four.linear_flops_effective == pytest.approx(1.6 * four.linear_flops)
    many = cost.price(BatchShape.decodes(32, 10))  # past the last point: the best rate
    assert many.linear_flops_effective == pytest.approx(many.linear_flops)
    plain = CostModel(model, HardwareSpec("cpu", {"bfloat16": 1e11}, 1e10, 8e9))
    assert plain.price(BatchShape.decodes(4, 10)).linear_flops_effective == four.linear_flops
    with pytest.raises(ValueError, match="matmul_rates"):
        HardwareSpec("cpu", {"bfloat16": 1e11}, 1e10, 8e9, matmul_rates={"layers": [[0, 1e9]]})


def test_a_sparse_mlp_by_hand():
    """A Qwen3-MoE shape: 2 layers, layer 0 dense, layer 1 with 8 experts of width 32, 2 a
    token. FLOPs count the experts a token runs; bytes, the experts its step's tokens touch."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
              "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "mlp_only_layers": [0]}  # fmt: skip
    spec = ModelSpec.from_hf_config(config)
    # Per layer: q 64*64 + k, v 64*32 each + o 64*64 + 2 norms of 64 + q/k norms of 16 = 12,448.
    # MLPs: dense 3*64*128 = 24,576; sparse 8 experts * (3*64*32 + a router row of 64) = 49,664.
    # Embedding and head 1000*64 each, final norm 64.
    assert spec.num_params == 2 * 12_448 + 24_576 + 49_664 + 2 * 64_000 + 64 == 227_200
    # Matmuls per token: attention 2*(2*64*64 + 2*64*32) = 24,576; dense MLP 24,576; the
    # sparse layer's 2 experts 2*6,144 and the router 64*8: 12,800.
    assert spec.linear_params == 24_576 + 24_576 + 12_800 == 61_952
    # Bytes (2 a weight): all but the input table, less the experts a step does not touch:
    # one token touches 2 of 8 (6 untouched); 3 tokens 8*(1 - (3/4)^3) = 4.625 (3.375 not).
    expert = 3 * 64 * 32 * 2
    assert spec.weight_bytes == (227_200 - 64_000) * 2
    assert spec.weight_bytes_for(1) == pytest.approx(spec.weight_bytes - 6 * expert)
    assert spec.weight_bytes_for(3) == pytest.approx(spec.weight_bytes - 3.375 * expert)
    cost = CostModel(spec, SLOW).price(BatchShape.decodes(1, 10))
    assert cost.weight_bytes == pytest.approx(spec.weight_bytes - 6 * expert)
    assert cost.linear_flops == 2 * 61_952 + 2 * 64 * 1000


def test_a_sliding_window_by_hand():
    """Mistral-style window of 4 keys: a chunk of 6 tokens after 2 cached sees
    min(p + 1, 4) keys at p = 2..7: 3 + 4 * 5 = 23 pairs (3 + ... + 8 = 33 without), and reads
    the last 6 - 1 + 4 = 9 of its 8 tokens of context at most: all 8."""
    assert BatchShape.from_seqs([(2, 6, True, False)], window=4).attention_pairs == 23
    assert BatchShape.from_seqs([(2, 6, True, False)]).attention_pairs == 33
    # A decode at position 100 under the window: 4 pairs, 4 keys read (not 101).
    decode = BatchShape.from_seqs([(100, 1, True, True)], window=4)
    assert (decode.attention_pairs, decode.kv_tokens_read) == (4, 4)
    spec = ModelSpec.from_hf_config({**PRESETS["Mistral-7B"], "sliding_window": 4096})
    assert spec.sliding_window == 4096
    decoding = types.SimpleNamespace(start=10_000, num_tokens=1, samples=True, is_decode=True)
    plan = types.SimpleNamespace(seqs=[decoding])
    cost = CostModel(spec, SLOW).price(plan)  # a plan is priced under the model's window
    assert cost.kv_read_bytes == 4096 * spec.kv_bytes_per_token


def test_windowed_layers_between_global_ones_by_hand():
    """Gemma 3's shape: 2 of 3 layers windowed to 4 keys. A decode at position 100: global
    layers 101 pairs and keys, windowed ones 4; the step's mean (2 * 4 + 101) / 3 = 36.33,
    36 rounded."""
    spec = dataclasses.replace(SMOL, layer_windows=(4, 4, 0))
    shape = spec.shape_of_seqs([(100, 1, True, True)])
    assert (shape.attention_pairs, shape.kv_tokens_read) == (36, 36)
    assert spec.shape_of(types.SimpleNamespace(seqs=[types.SimpleNamespace(
        start=100, num_tokens=1, samples=True, is_decode=True)])) == shape  # fmt: skip


def test_a_gguf_is_priced_at_the_bytes_its_types_store():
    """The mixed fixture (tests/fixtures/make_kquant_fixture.py), worked out by hand from the
    types' layouts: a row of n inputs takes n / 256 super-blocks of 84 (Q2_K), 110 (Q3_K), 144
    (Q4_K), 176 (Q5_K), 210 (Q6_K) or 136 (IQ4_XS) bytes, n / 32 blocks of 34 (Q8_0, and Q5_0,
    made int8 blocks); the F32 norms are priced at 2."""
    from pathlib import Path

    spec = ModelSpec.from_path(Path(__file__).parent / "fixtures" / "tiny-kquant.gguf")
    table = 49152 * 144  # Q4_K, tied: read whole as the head
    # q Q4_K, k Q5_K, v Q6_K, o Q6_K, gate Q5_K, up Q4_K, down (512 inputs) Q3_K
    layer0 = 256 * 144 + 128 * 176 + 128 * 210 + 256 * 210 + 512 * 176 + 512 * 144 + 256 * 220
    # q, k, v Q8_0; o IQ4_XS; gate Q2_K; up IQ4_XS; down (512 inputs) Q5_0 as int8 blocks
    layer1 = 256 * 272 + 2 * 128 * 272 + 256 * 136 + 512 * 84 + 512 * 136 + 256 * 544
    norms = 5 * 256 * 2
    attention, mlp = 2 * 256 * 256 + 2 * 128 * 256, 3 * 256 * 512
    params = 49152 * 256 + 2 * (attention + mlp) + 5 * 256
    assert spec.num_params == params
    assert spec.weight_bytes == pytest.approx(table + layer0 + layer1 + norms)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 40),  # start
            st.integers(1, 5),  # tokens (with drafts: 1 + drafts)
            st.integers(0, 40),  # prompt tokens
            st.booleans(),  # samples
            st.integers(0, 3),  # drafts
            st.integers(0, 3),  # prompt tokens scored
        ),
        max_size=8,
    )
)
def test_a_plan_is_counted_and_shaped_as_its_sequences_say(seqs):
    """StepPlan.token_counts and BatchShape.from_plan count inline what SeqPlan's properties
    define (is_decode, num_logits): both must agree with them, seq by seq."""
    plan = StepPlan(0, [])
    for start, n, n_prompt, samples, drafts, scored in seqs:
        seq = SeqPlan("r", [7] * (1 + drafts if drafts else n), start, n_prompt, [[0]], samples)
        seq.draft_token_ids = [7] * drafts if drafts else None
        seq.prompt_logprob_token_ids = [7] * scored if scored else None
        plan.seqs.append(seq)
    tokens = sum(s.num_tokens for s in plan.seqs)
    decode = sum(s.num_tokens for s in plan.seqs if s.is_decode)
    assert plan.token_counts() == (tokens, decode)
    assert plan.num_decode_tokens == decode
    reference = [(s.start, s.num_tokens, s.num_logits, s.is_decode) for s in plan.seqs]
    assert BatchShape.from_plan(plan) == BatchShape.from_seqs(reference)
