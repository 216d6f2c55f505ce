"""POST /v1/embeddings through the `openai` client unmodified (which asks for base64 and decodes
it) and as LangChain sends it (token ids), against sentence-transformers on the same weights
(the test server runs the default model in fp32; a model without sentence-transformers files
pools its last token, normalized); float and base64 agree; usage counts the inputs' tokens; a
batch of 32 inputs comes back in order; refusals name the field. Then all-MiniLM-L6-v2 served
by name (`quill serve all-minilm-l6-v2`): its embeddings, rerank in Jina's / Cohere's shape
(/v1/rerank, /rerank, /v2/rerank) and vLLM's /v1/score by the cosine of its vectors; and a
decoder reranker served with `--task score`."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules.transformer import Transformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

from quill import LLM
from quill.model.default_model import default_model_dir

TEXTS = ["Hello there, how are you today?", "Embeddings for the search index.", "a"]


@pytest.fixture(scope="module")
def reference():
    text = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    module = Transformer(str(default_model_dir()), model_kwargs={"dtype": torch.float32},
                         modality_config=text, module_output_name="token_embeddings")  # fmt: skip
    pooling = Pooling(module.get_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[module, pooling, Normalize()], device="cpu")
    return lambda texts: model.encode(texts, convert_to_numpy=True)


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_openai_client_gets_the_reference_vectors(client, model_name, reference, http):
    r = client.embeddings.create(model=model_name, input=TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == model_name
    want = reference(TEXTS)
    assert min(_cosine(d.embedding, w) for d, w in zip(r.data, want)) >= 0.99999
    counted = sum(http.post("/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == counted
    # Floats asked for by name, and base64 decoded by hand: the same values (to rounding: the
    # second time the prefix cache holds all but each prompt's last token).
    plain = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    coded = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})
    assert plain.status_code == coded.status_code == 200
    for d, p, c in zip(r.data, plain.json()["data"], coded.json()["data"]):
        vector = np.frombuffer(base64.b64decode(c["embedding"]), "<f4")
        assert vector.dtype == np.float32 and len(vector) == len(p["embedding"])
        assert np.allclose(vector, p["embedding"], atol=1e-5)
        assert np.allclose(d.embedding, p["embedding"], atol=1e-5)


def test_token_ids_as_langchain_sends_them(client, model_name, http):
    ids = [http.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    by_ids = client.embeddings.create(model=model_name, input=ids)
    by_text = client.embeddings.create(model=model_name, input=TEXTS)
    for a, b in zip(by_ids.data, by_text.data):
        assert np.allclose(a.embedding, b.embedding, atol=1e-5)
    one = client.embeddings.create(model=model_name, input=ids[0])
    assert len(one.data) == 1
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-5)


def test_a_batch_comes_back_in_order(client, model_name, http):
    texts = [f"document number {i} about topic {i % 7}" for i in range(32)]
    batch = client.embeddings.create(model=model_name, input=texts)
    assert [d.index for d in batch.data] == list(range(32))
    # Each input is a sequence: past --max-seqs-per-request (32 here) the batch is refused.
    r = http.post("/v1/embeddings", json={"input": texts + ["one more"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    for i in (0, 17, 31):
        alone = client.embeddings.create(model=model_name, input=texts[i]).data[0].embedding
        assert _cosine(alone, batch.data[i].embedding) >= 0.99999


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ({"input": [[10**9]]}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 3}, "input"),
    ],
)
def test_refusals_name_the_field(http, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


@pytest.fixture(scope="module")
def minilm_server():
    from conftest import SERVER_ARGS, running_server

    from quill.model.named_models import named_model_path

    path = named_model_path("all-minilm-l6-v2")
    with running_server(["all-minilm-l6-v2", *SERVER_ARGS]) as srv:
        yield srv, path


def test_an_embedding_model_served_by_name(minilm_server):
    """`quill serve all-minilm-l6-v2`: the encoder's mean-pooled, normalized vectors (as its
    sentence-transformers files say) through the openai client; generation refused."""
    srv, path = minilm_server
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="test-key", max_retries=0)
    r = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS)
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert min(_cosine(d.embedding, w) for d, w in zip(r.data, want)) >= 0.99999
    assert len(r.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError, match="encoder"):
        client.completions.create(model="all-minilm-l6-v2", prompt="Hello", max_tokens=2)


def test_rerank_and_score_by_an_embedding_model(minilm_server):
    """Jina's / Cohere's rerank shape and vLLM's score pairs, on all-MiniLM-L6-v2 (cosine)."""
    srv, path = minilm_server
    headers = {"Authorization": "Bearer test-key"}
    query = "What is the capital of France?"
    docs = ["Bananas are yellow.", "Paris is the capital of France.", "I like trains."]
    st = SentenceTransformer(str(path), device="cpu")
    q, *d = st.encode([query, *docs], convert_to_numpy=True)
    want = [_cosine(q, v) for v in d]
    with httpx.Client(base_url=srv.base_url, headers=headers, timeout=60) as http:
        for path_ in ("/v1/rerank", "/rerank", "/v2/rerank"):
            body = {"query": query, "documents": [docs[0], {"text": docs[1]}, docs[2]],
                    "top_n": 2}  # fmt: skip
            r = http.post(path_, json=body)
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -want[i])[:2]
            for x in results:
                assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
                assert x["document"]["text"] == docs[x["index"]]
        bare = http.post("/v1/rerank", json={"query": query, "documents": docs,
                                             "return_documents": False}).json()  # fmt: skip
        assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
        assert bare["usage"]["total_tokens"] > 0
        score = http.post("/v1/score", json={"text_1": query, "text_2": docs}).json()
        assert [x["score"] for x in score["data"]] == pytest.approx(want, abs=1e-5)
        pairwise = http.post("/score", json={"text_1": [query, docs[0]],
                                             "text_2": [docs[1], docs[0]]}).json()  # fmt: skip
        assert pairwise["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)
        refusals = [({"query": query, "documents": []}, "documents"),
                    ({"query": "", "documents": docs}, "query"),
                    ({"query": query, "documents": docs, "top_n": 0}, "top_n")]  # fmt: skip
        for body, param in refusals:
            r = http.post("/v1/rerank", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"


def test_a_generating_model_scores_nothing(http):
    r = http.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_a_decoder_reranker_served_with_task_score(tmp_path_factory):
    from conftest import SERVER_ARGS, running_server

    from tests.chat_fixtures import family_model

    directory = family_model(tmp_path_factory.mktemp("reranker"), "qwen3", "qwen3")
    docs = ["Paris is the capital of France.", "Bananas are yellow."]
    with LLM(str(directory), task="score", dtype="float32", kv_cache_dtype="float32",
             quantization="none", kv_cache_memory=32 << 20) as llm:  # fmt: skip
        want = llm.score("capital of France?", docs, use_tqdm=False)
    args = [str(directory), *SERVER_ARGS, "--task", "score", "--kv-cache-memory", "32MiB"]
    with running_server(args) as srv:
        with httpx.Client(base_url=srv.base_url, headers={"Authorization": "Bearer test-key"},
                          timeout=60) as http:  # fmt: skip
            r = http.post("/v1/rerank", json={"query": "capital of France?", "documents": docs})
            assert r.status_code == 200, r.text
            got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert [got[0], got[1]] == pytest.approx(want, abs=1e-5)
