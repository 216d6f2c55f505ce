"""EmbeddingGemma's shape (Gemma 3 with bidirectional attention, mean pooling, two Dense
projections 768 -> 3072 -> 768, normalized) with random weights, as a sentence-transformers
directory, against sentence-transformers loading the same directory (fp32): each vector within
cosine 0.99999, prompts longer than half the sliding window (so the sliding layers' symmetric
window masks keys on both sides) beside short ones in one step."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.dense import Dense

from quill import LLM, SamplingParams
from quill.contract.errors import InvalidRequestError

# EmbeddingGemma-300m's widths; 6 layers (5 sliding, then a global one, its pattern) instead
# of 24; the default model's tokenizer (its vocabulary) instead of Gemma's 262k; a window of
# 64 (32 either side) instead of 512, so that short texts cross it.
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
SHAPE = dict(hidden_size=768, intermediate_size=1152, num_attention_heads=3,
             num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
             sliding_window=64, num_hidden_layers=6, max_position_embeddings=2048,
             layer_types=["sliding_attention"] * 5 + ["full_attention"],
             rope_parameters=ROPE)  # fmt: skip
TEXTS = [
    "What is the capital of France?",
    "Paris is the capital and largest city of France. " * 12,  # past the 32-token half window
    "a",
    "title: none | text: Embeddings index the documents a retriever searches.",
    "The quick brown fox jumps over the lazy dog. " * 4,
]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    from tests.conftest import random_checkpoint

    root = tmp_path_factory.mktemp("embeddinggemma")
    reference = random_checkpoint(root, "embeddinggemma", sharded=False, **SHAPE)
    with torch.no_grad():  # smaller weights than the test default: a deep stack stays finite
        for p in reference.parameters():
            p.normal_(0, 0.05)
    reference.save_pretrained(str(root))
    modules = [("0", "", "base.modules.transformer.Transformer"),
               ("1", "1_Pooling", "sentence_transformer.modules.Pooling"),
               ("2", "2_Dense", "base.modules.dense.Dense"),
               ("3", "3_Dense", "base.modules.dense.Dense"),
               ("4", "4_Normalize", "sentence_transformer.modules.Normalize")]  # fmt: skip
    (root / "modules.json").write_text(json.dumps([
        {"idx": i, "name": name, "path": path, "type": f"sentence_transformers.{kind}"}
        for i, (name, path, kind) in enumerate(modules)]))  # fmt: skip
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True}))  # fmt: skip
    torch.manual_seed(1)
    for folder, (n_in, n_out) in (("2_Dense", (768, 3072)), ("3_Dense", (3072, 768))):
        (root / folder).mkdir()
        Dense(n_in, n_out, bias=False, activation_function=torch.nn.Identity()).save(
            str(root / folder)
        )
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048}))
    return root


def test_embedding_gemma_matches_sentence_transformers(directory):
    model = SentenceTransformer(str(directory), device="cpu",
                                model_kwargs={"dtype": torch.float32})  # fmt: skip
    assert [type(m).__name__ for m in model] == ["Transformer", "Pooling", "Dense", "Dense",
                                                 "Normalize"]  # fmt: skip
    want = model.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    with LLM(str(directory), dtype="float32") as llm:
        assert llm.engine.worker.info.task == "embed"  # --task auto: a bidirectional model embeds
        lengths = [len(llm.tokenizer.encode(t)) for t in TEXTS]
        assert max(lengths) > 2 * 32 + 1  # keys masked on both sides in the sliding layers
        got = llm.embed(TEXTS, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="encoder"):
            llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    cosines = [float(torch.dot(torch.tensor(g), w)) for g, w in zip(got, want.float())]
    assert all(len(g) == 768 for g in got)
    assert min(cosines) >= 0.99999, cosines


def test_dense_modules_run_only_where_a_prompt_pools_whole(directory):
    """The front end's reading of the pipeline: an encoder's Dense modules run (after its
    pooling); on a causal model, whose mean the engine sums chunk by chunk, they are refused
    by name rather than skipped."""
    from quill.frontend.pooling_config import PoolingConfig

    assert PoolingConfig.read(directory, encoder=True).params(None, None).type == "mean"
    with pytest.raises(InvalidRequestError, match="Dense, Dense"):
        PoolingConfig.read(directory, encoder=False).params(None, None)
