"""Code infill prompts in each family's fill-in-the-middle tokens, built by hand here from the
families' published layouts and compared id for id with quill/frontend/infill.py's."""

from __future__ import annotations

import pytest

from quill.contract.errors import InvalidRequestError
from quill.frontend.infill import KNOWN, ExtraFile, find_fim_tokens, infill_prompt
from quill.frontend.tokenizer import Tokenizer

PREFIX, SUFFIX = "def area(r):\n    return ", "\n\nprint(area(2))\n"
# family: (prefix, suffix, middle, file separator, repository name)
NAMES = {
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
             "<|repo_name|>"),
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<reponame>"),
    "codellama": ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None),
    "deepseek": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),
}  # fmt: skip


def _tokenizer(directory, names) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    from quill.model.default_model import default_model_dir

    source = default_model_dir()
    backend = Backend.from_file(str(source / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(n, special=True) for n in names if n])
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    return Tokenizer.load(directory)


@pytest.mark.parametrize("family", list(NAMES))
def test_the_prompt_is_prefix_suffix_middle_in_the_family_tokens(tmp_path, family):
    pre, suf, mid, sep, repo = NAMES[family]
    tok = _tokenizer(tmp_path / family, NAMES[family])
    assert find_fim_tokens(tok).family == family

    def one(name):
        return [tok.backend.token_to_id(name)]

    def text(value):
        return tok.encode(value, add_special_tokens=False)

    lead = " " if family == "codellama" else ""  # "<PRE> {prefix} <SUF>{suffix} <MID>"
    hole = one(pre) + text(lead + PREFIX) + one(suf) + text(SUFFIX) + one(mid)
    assert infill_prompt(tok, PREFIX, SUFFIX) == hole
    extra = [ExtraFile("geometry/util.py", "PI = 3.14159\n"), ExtraFile("README", "Areas.")]
    got = infill_prompt(tok, PREFIX, SUFFIX, extra, repo="shapes")
    if sep is not None:  # repository-level layout: the name, then each file after a separator
        files = one(repo) + text("shapes\n")
        for f in extra:
            files += one(sep) + text(f"{f.filename}\n{f.text}")
        assert got == files + one(sep) + hole
    else:  # no separator token: the files as text before the prefix
        context = "".join(f"{f.filename}\n{f.text}\n" for f in extra)
        assert got == one(pre) + text(lead + context + PREFIX) + one(suf) + text(SUFFIX) + one(mid)


def test_every_known_family_is_covered():
    assert {f.family for f in KNOWN} == set(NAMES)


def test_a_model_without_fim_tokens_is_told_so(model_dir):
    tok = Tokenizer.load(model_dir)
    assert find_fim_tokens(tok) is None
    with pytest.raises(InvalidRequestError, match="fill-in-the-middle") as e:
        infill_prompt(tok, "a", "b")
    assert e.value.param == "suffix"
