"""Code infill (fill-in-the-middle): the text between a prefix and a suffix, written by a code
model trained for it, from a prompt laid out in the model's own FIM tokens.

Code models mark the hole with three tokens and take prefix-suffix-middle order: the prefix
token, the code before the cursor, the suffix token, the code after, the middle token; the
reply is the middle. The tokens' names differ by family; quill finds them in the vocabulary:

- Qwen2.5-Coder (and CodeGemma): `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`, with
  `<|repo_name|>` and `<|file_sep|>` for repository context;
- StarCoder / StarCoder2: `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`, `<reponame>`,
  `<file_sep>`;
- CodeLlama: `▁<PRE>`, `▁<SUF>`, `▁<MID>` (`<PRE> {prefix} <SUF>{suffix} <MID>`);
- DeepSeek-Coder: `<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>`.

Other files as context (llama-server's `input_extra`) go before the hole, each after the file
separator with its name on the first line (the repository-level layout these models were
trained on); a model without a file separator gets them as plain text before the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from quill.contract.errors import InvalidRequestError


@dataclass(frozen=True)
class FimTokens:
    family: str
    prefix: str
    suffix: str
    middle: str
    file_sep: str | None = None
    repo_name: str | None = None
    space_after_prefix: bool = False  # CodeLlama: "<PRE> {prefix}"


KNOWN = (
    FimTokens("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
              "<|repo_name|>"),
    FimTokens("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>",
              "<reponame>"),
    FimTokens("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", space_after_prefix=True),
    FimTokens("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)  # fmt: skip


def find_fim_tokens(tokenizer) -> FimTokens | None:
    """The FIM tokens of the model's vocabulary (None: it has none)."""
    for fim in KNOWN:
        names = (fim.prefix, fim.suffix, fim.middle)
        if all(tokenizer.backend.token_to_id(name) is not None for name in names):
            return fim
    return None


@dataclass(frozen=True)
class ExtraFile:
    filename: str
    text: str


def infill_prompt(
    tokenizer,
    prefix: str,
    suffix: str,
    extra: list[ExtraFile] = (),
    repo: str | None = None,
    param: str = "suffix",
) -> list[int]:
    """The prompt ids that ask the model for the text between `prefix` and `suffix`; a 400
    naming `param` when the model has no FIM tokens."""
    fim = find_fim_tokens(tokenizer)
    if fim is None:
        raise InvalidRequestError(
            "this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
            "<fim_prefix> or <PRE>), so it cannot infill: serve a code model trained for it",
            param,
        )

    def token(name: str) -> list[int]:
        return [tokenizer.backend.token_to_id(name)]

    def text(value: str) -> list[int]:
        return tokenizer.encode(value, add_special_tokens=False) if value else []

    ids: list[int] = []
    if fim.file_sep is not None and tokenizer.backend.token_to_id(fim.file_sep) is not None:
        if repo and fim.repo_name and tokenizer.backend.token_to_id(fim.repo_name) is not None:
            ids += token(fim.repo_name) + text(repo + "\n")
        for f in extra:
            ids += token(fim.file_sep) + text(f"{f.filename}\n{f.text}")
        if extra:
            ids += token(fim.file_sep)  # the file being edited follows
    else:
        prefix = "".join(f"{f.filename}\n{f.text}\n" for f in extra) + prefix
    lead = " " if fim.space_after_prefix else ""
    ids += token(fim.prefix) + text(lead + prefix) + token(fim.suffix) + text(suffix)
    return ids + token(fim.middle)
