"""Pooling requests (embeddings) in the engine, against sentence-transformers on the same
weights (fp32): the default model's final hidden states pooled by the last token, the mean and
the first token, normalized, with prompts longer than the token budget (pooled chunk by chunk),
beside generation in the same steps, and after the prefix cache holds their prompts. Also the
contract: the vector's `dimensions` and normalization, the plan's pooling per chunk, and the
request through the engine process's codec."""

from __future__ import annotations

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
