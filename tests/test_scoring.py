"""Scoring pairs for reranking (quill/frontend/scoring.py, LLM.score): a Qwen3-Reranker-shaped
decoder (random weights, `task="score"`) scored by P(yes) over yes and no at the end of the
reranker's prompt, against transformers' logits on the same weights; an embedding model
(all-MiniLM-L6-v2) scoring by the cosine of its vectors, against sentence-transformers."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM

from quill import LLM
from quill.contract.errors import InvalidRequestError
from quill.frontend.scoring import Scorer
from quill.model.named_models import named_model_path
from tests.chat_fixtures import family_model

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "x",
        "The capital of France, for centuries, has been Paris " * 4]  # fmt: skip


def test_a_decoder_reranker_scores_by_yes_against_no(tmp_path):
    directory = family_model(tmp_path / "qwen3-reranker", "qwen3", "qwen3")
    with LLM(str(directory), task="score", dtype="float32", kv_cache_dtype="float32",
             quantization="none", kv_cache_memory=32 << 20) as llm:  # fmt: skip
        got = llm.score(QUERY, DOCS, use_tqdm=False)
        custom = llm.score(QUERY, DOCS[:1], instruction="Judge relevance.", use_tqdm=False)
        tok = llm.tokenizer
        scorer = Scorer.for_model("yes_no", tok, None)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    yes, no = scorer.yes_no
    cases = [([(QUERY, d) for d in DOCS], got, None),
             ([(QUERY, DOCS[0])], custom, "Judge relevance.")]  # fmt: skip
    for pairs, scores, instruction in cases:
        for (ids, _), score in zip(scorer.inputs(tok, pairs, instruction), scores):
            assert "<Instruct>: " + (instruction or "Given a web search") in tok.decode(ids)
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0, -1]
            want = torch.softmax(torch.stack([logits[yes], logits[no]]), 0)[0].item()
            assert score == pytest.approx(want, abs=1e-5)


def test_an_embedding_model_scores_by_cosine():
    path = named_model_path("all-minilm-l6-v2")
    with LLM(str(path), dtype="float32") as llm:
        got = llm.score(QUERY, DOCS, use_tqdm=False)
    st = SentenceTransformer(str(path), device="cpu")
    q, *d = st.encode([QUERY, *DOCS], convert_to_tensor=True)
    want = torch.nn.functional.cosine_similarity(q[None], torch.stack(d)).tolist()
    assert got == pytest.approx(want, abs=1e-5)
    assert got[0] > got[1]  # a real model: Paris answers the question, bananas do not


def test_a_generating_model_scores_nothing():
    with LLM(dtype="float32", kv_cache_memory=32 << 20) as llm:
        with pytest.raises(InvalidRequestError, match="scores nothing"):
            llm.score(QUERY, DOCS, use_tqdm=False)


def test_a_cross_encoder_scores_both_texts_at_once(tmp_path):
    """A BertForSequenceClassification reranker (random weights of a small shape, MiniLM's
    tokenizer): sentence-transformers' CrossEncoder on the same directory, and transformers'
    logits through a sigmoid, give quill's scores."""
    import shutil

    from sentence_transformers import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, num_labels=1,
                        initializer_range=0.2)  # fmt: skip
    directory = tmp_path / "cross-encoder"
    BertForSequenceClassification(config).eval().save_pretrained(directory)
    minilm = named_model_path("all-minilm-l6-v2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)
    with LLM(str(directory), dtype="float32") as llm:
        assert llm.engine.worker.info.task == "score"
        got = llm.score(QUERY, DOCS, use_tqdm=False)
    want = CrossEncoder(str(directory), device="cpu").predict([(QUERY, d) for d in DOCS])
    assert got == pytest.approx([float(w) for w in want], abs=1e-5)
    assert max(got) - min(got) > 1e-4  # the documents score apart: the second text counts
