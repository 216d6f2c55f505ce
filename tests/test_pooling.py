"""Pooling requests (embeddings) in the engine, against sentence-transformers on the same
weights (fp32): the default model's final hidden states pooled by the last token, the mean and
the first token, normalized, with prompts longer than the token budget (pooled chunk by chunk),
beside generation in the same steps, and after the prefix cache holds their prompts. Also the
contract: the vector's `dimensions` and normalization, the plan's pooling per chunk, and the
request through the engine process's codec."""

from __future__ import annotations

import json
import math

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.transformer import Transformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

from quill import LLM, SamplingParams
from quill.contract.codec import Codec
from quill.contract.errors import InvalidRequestError
from quill.contract.messages import EngineRequest
from quill.contract.pooling import PoolingParams, add_pooled, finish_embedding
from quill.model.default_model import default_model_dir

TEXTS = [
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog. " * 6,  # past the 32-token budget: chunked
    "a",
    "Retrieval-augmented generation needs embeddings for the search index.",
]
ST_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


@pytest.fixture(scope="module")
def llm():
    # A small token budget, so that the longer prompts pool over several chunks.
    with LLM(dtype="float32", kv_cache_dtype="float32", quantization="none",
             kv_cache_memory=64 << 20, max_num_batched_tokens=32) as llm:  # fmt: skip
        yield llm


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """sentence-transformers' embeddings of TEXTS, per pooling (the model's plain text input:
    no chat template)."""
    text = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    module = Transformer(str(default_model_dir()), model_kwargs={"dtype": torch.float32},
                         modality_config=text, module_output_name="token_embeddings")  # fmt: skip
    out = {}
    for kind, mode in ST_MODES.items():
        pooling = Pooling(module.get_embedding_dimension(), pooling_mode=mode)
        model = SentenceTransformer(modules=[module, pooling, Normalize()], device="cpu")
        out[kind] = model.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    return out


def _cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return [float(torch.dot(torch.tensor(g), w)) for g, w in zip(got, want.float())]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embeddings_match_sentence_transformers(llm, reference, kind):
    ids = [llm.tokenizer.encode(t) for t in TEXTS]
    assert max(len(i) for i in ids) > 32  # one prompt pools over several chunks
    got = llm.embed(TEXTS, PoolingParams(kind), use_tqdm=False)
    assert all(len(g) == reference[kind].shape[1] for g in got)
    assert all(abs(math.hypot(*g) - 1) < 1e-5 for g in got)
    assert min(_cosines(got, reference[kind])) >= 0.99999


def test_pooling_beside_generation_changes_neither(llm, reference):
    generate = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    pool = SamplingParams(max_tokens=0, pooling=PoolingParams("mean"))
    alone = llm.generate(TEXTS, generate, use_tqdm=False)
    mixed = llm.generate(TEXTS + TEXTS, [generate] * len(TEXTS) + [pool] * len(TEXTS),
                         use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[: len(TEXTS)]] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert all(o.embedding is None for o in mixed[: len(TEXTS)])
    pooled = [o.embedding for o in mixed[len(TEXTS) :]]
    assert all(o.outputs[0].token_ids == [] for o in mixed[len(TEXTS) :])
    assert min(_cosines(pooled, reference["mean"])) >= 0.99999
    # The prompts are in the prefix cache now: a mean still pools every row (computed again).
    again = llm.embed(TEXTS, PoolingParams("mean"), use_tqdm=False)
    assert min(_cosines(again, reference["mean"])) >= 0.99999
    last = llm.embed(TEXTS, PoolingParams("last"), use_tqdm=False)
    assert min(_cosines(last, reference["last"])) >= 0.99999


def test_dimensions_and_normalize(llm):
    full = llm.embed(TEXTS[:1], PoolingParams("mean", normalize=False), use_tqdm=False)[0]
    cut = llm.embed(TEXTS[:1], PoolingParams("mean", dimensions=64), use_tqdm=False)[0]
    assert len(cut) == 64
    want = torch.nn.functional.normalize(torch.tensor(full[:64]), dim=0)
    assert torch.allclose(torch.tensor(cut), want, atol=1e-6)
    assert abs(math.hypot(*full) - 1) > 1e-3  # left as the model gave it


def test_pooling_contract():
    assert finish_embedding(add_pooled(([1.0, 2.0], 1), ([3.0, 4.0], 1), "mean"),
                            PoolingParams("mean", normalize=False)) == [2.0, 3.0]  # fmt: skip
    assert finish_embedding(([3.0, 4.0, 12.0], 1), PoolingParams("cls", dimensions=2)) == [0.6, 0.8]
    with pytest.raises(InvalidRequestError, match="pooling"):
        PoolingParams("max")
    with pytest.raises(InvalidRequestError, match="max_tokens 0"):
        SamplingParams(max_tokens=3, pooling=PoolingParams())
    request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=0,
                            pooling=PoolingParams("cls", False, 8)), 0.0, 0)  # fmt: skip
    codec = Codec()
    back = codec.decode(codec.encode(request))
    assert back.sampling_params.pooling == PoolingParams("cls", False, 8)


@pytest.mark.parametrize("mode", ["pooling_mode_lasttoken", "pooling_mode_mean_tokens"])
def test_a_sentence_transformers_directory_pools_as_it_says(tmp_path, mode):
    """A Qwen3-Embedding-shaped directory (random weights, its pipeline in modules.json and
    1_Pooling/config.json): quill's default pooling for it is the directory's own, and its
    vectors are what sentence-transformers makes of the same directory."""
    from tests.chat_fixtures import family_model

    directory = family_model(tmp_path / "qwen3-embedding", "qwen3", "qwen3")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    width = json.loads((directory / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": width, "pooling_mode_mean_tokens": False, mode: True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    texts = ["What is the capital of France?", "Paris is the capital of France. " * 5]
    want = SentenceTransformer(str(directory), device="cpu",
                               model_kwargs={"dtype": torch.float32}).encode(
        texts, convert_to_tensor=True)  # fmt: skip
    with LLM(str(directory), dtype="float32", kv_cache_dtype="float32", quantization="none",
             kv_cache_memory=32 << 20, max_num_batched_tokens=16) as llm:  # fmt: skip
        got = llm.embed(texts, use_tqdm=False)
    assert min(_cosines(got, want)) >= 0.99999


def test_a_tokenizer_that_pads_is_read_as_its_tokens(tmp_path):
    """BERT-family tokenizer.json files pad and truncate every text to a fixed length."""
    from tokenizers import Tokenizer as Backend

    from quill.frontend.tokenizer import Tokenizer

    source = default_model_dir()
    backend = Backend.from_file(str(source / "tokenizer.json"))
    backend.enable_padding(length=128)
    backend.enable_truncation(max_length=128)
    for name in ("tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    backend.save(str(tmp_path / "tokenizer.json"))
    assert len(backend.encode("Hello world").ids) == 128
    tok = Tokenizer.load(tmp_path)
    assert tok.encode("Hello world") == Tokenizer.load(source).encode("Hello world")
    assert len(tok.encode("word " * 300)) > 128
