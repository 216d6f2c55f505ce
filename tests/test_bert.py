"""The BERT encoder (quill/model/bert.py) on all-MiniLM-L6-v2 from its wheel (`make models`),
against sentence-transformers loading the same directory (fp32): the vectors of a reference
set (short, long, at the model's 256-token length, a batch of many) within cosine 0.99999;
each prompt taken whole in one step under a token budget smaller than the batch; what an
encoder cannot do refused by name."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer

from quill import LLM, SamplingParams
from quill.contract.errors import InvalidRequestError
from quill.model.named_models import named_model_path

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Embeddings for retrieval-augmented generation " * 12,
    "a",
    "Ünïcödé, emoji 🙂 and CJK 漢字 in one sentence.",
] + [f"document {i}: the weather in city number {i} is mild" for i in range(25)]


@pytest.fixture(scope="module")
def minilm():
    return named_model_path("all-minilm-l6-v2")  # a clear error, not a skip, without the wheel


@pytest.fixture(scope="module")
def reference(minilm):
    model = SentenceTransformer(str(minilm), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=32)


def test_minilm_matches_sentence_transformers(minilm, reference):
    # A budget of 128 tokens a step: the 32 prompts (up to ~100 tokens) take many steps, each
    # prompt whole in one of them.
    with LLM(str(minilm), dtype="float32", max_num_batched_tokens=128) as llm:
        assert llm.engine.max_model_len == 256  # the length sentence-transformers embeds
        lengths = [len(llm.tokenizer.encode(t)) for t in TEXTS]
        assert max(lengths) > 64 and sum(lengths) > 128
        got = llm.embed(TEXTS, use_tqdm=False)
        long = llm.tokenizer.decode(llm.tokenizer.encode("word " * 400)[1:255])
        with pytest.raises(InvalidRequestError, match="token budget"):
            llm.embed([long], use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="encoder"):
            llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    cosines = [float(torch.dot(torch.tensor(g), w)) for g, w in zip(got, reference)]
    assert min(cosines) >= 0.99999, cosines
    assert all(len(g) == 384 for g in got)


def test_a_prompt_at_the_models_length(minilm):
    """256 tokens, the longest sentence-transformers embeds (and the default budget holds)."""
    model = SentenceTransformer(str(minilm), device="cpu")
    with LLM(str(minilm), dtype="float32") as llm:
        ids = llm.tokenizer.encode("word " * 400)
        text = llm.tokenizer.decode(ids[1:255])  # [CLS] 254 words [SEP]: 256 tokens
        assert len(llm.tokenizer.encode(text)) == 256
        got = torch.tensor(llm.embed([text], use_tqdm=False)[0])
        with pytest.raises(InvalidRequestError):
            llm.embed([text + " more words"], use_tqdm=False)
    want = model.encode([text], convert_to_tensor=True)[0]
    assert float(torch.dot(got, want)) >= 0.99999
