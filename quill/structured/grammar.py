"""Constraints compiled into llguidance grammars for one tokenizer, and the matcher per reply.

llguidance (torch-free, no dependencies) turns a JSON schema, a regular expression or a Lark
grammar into a matcher that gives, token by token, the bitmask of tokens that may come next
(bit t of byte t // 8, least significant first: the layout `SeqPlan.token_bitmask` carries)
and refuses, with its own message, a grammar it cannot compile. A schema keyword it cannot
enforce (uniqueItems, if/then, contains, ...) is ignored and named in the compile's warnings,
as vLLM and llama.cpp serve such schemas. Compiled grammars and failures are cached by
constraint (the most recent `CACHE_SIZE`), so a repeated schema costs nothing twice.

Compiling recurses on the C stack: call `compile` and make matchers on a deep-stack thread
(quill/structured/threads.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError

from quill.contract.constraint import Constraint
from quill.structured.schema import bounded_numbers

# JSON without free whitespace between tokens (", " and ": " as separators): a model may
# otherwise pad a reply with whitespace until it runs out of tokens. Keywords the library
# cannot enforce are ignored with a warning (lenient). A schema's own "x-guidance" options
# override these.
_COMPACT = {"whitespace_flexible": False, "lenient": True}
CACHE_SIZE = 512


class GrammarError(ValueError):
    """The constraint cannot be enforced: the library's reason."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    if constraint.think_end:
        return _after_thinking(constraint)
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        schema = bounded_numbers(json.loads(value))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = json.loads(value)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice needs a non-empty list of strings")
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if "::=" in value:  # GBNF / EBNF, as llama.cpp takes it
        return llguidance.grammar_from("gbnf", value)
    return llguidance.LLMatcher.grammar_from_lark(value)


def _after_thinking(constraint: Constraint) -> str:
    """The grammar of free thinking up to the first end marker (and the whitespace after),
    then the answer's own grammar: one llguidance grammar set, the answer's by name."""
    answer = grammar_text(replace(constraint, think_start="", think_end=""))
    if answer.lstrip().startswith("{"):
        grammars = json.loads(answer)["grammars"]
    else:
        grammars = [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": "answer"}
    if constraint.think_end.startswith("<["):  # a token: text runs until it
        thinking = f"thinking: THINKING {constraint.think_end}\nTHINKING: /(?s:.*)/"
    else:  # text: up to the first time the marker is written
        end = _lark_regex(json.loads(constraint.think_end))
        thinking = f"thinking: THINKING\nTHINKING: /(?s:.*){end}/ & ~/(?s:.*{end}.+)/"
    if constraint.think_start:
        start = f"start: ({constraint.think_start} thinking SPACE)? @answer"
    else:
        start = "start: thinking SPACE @answer"
    # At most 4 characters of whitespace between: a model may otherwise write it until
    # max_tokens (as with numbers, quill/structured/schema.py).
    lark = f"{start}\n{thinking}\nSPACE: /[ \\t\\r\\n]{{0,4}}/\n"
    return json.dumps({"grammars": [{"name": "reply", "lark_grammar": lark}, *grammars]})


def _lark_regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


@dataclass(frozen=True)
class Compiled:
    """A checked grammar, and what of its constraint it does not enforce (the warnings)."""

    grammar: str
    warnings: tuple[str, ...] = ()


class Grammars:
    """Compiles and caches grammars for one model's tokenizer (`tokenizer.json`), whose
    end-of-text ids are the model's own (they end a constrained reply)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, end_token_ids: list[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(
            str(tokenizer_json), n_vocab=vocab_size, eos_token=list(end_token_ids)
        )
        self.vocab_size = vocab_size
        self.end_token_ids = frozenset(end_token_ids)
        self._cache: OrderedDict[Constraint, Compiled | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Compiled:
        """The checked grammar; raises GrammarError (cached, as the grammar is)."""
        with self._lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
        if found is None:
            found = self._compile(constraint)
            with self._lock:
                self._cache[constraint] = found
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def _compile(self, constraint: Constraint) -> Compiled | GrammarError:
        try:
            grammar = grammar_text(constraint)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer
            )
        except GrammarError as e:
            return e
        except (ValueError, RuntimeError, RecursionError, GbnfToLarkError) as e:
            return GrammarError(str(e))  # the library's refusal
        if failed:
            return GrammarError(messages[0] if messages else "the grammar is invalid")
        return Compiled(grammar, tuple(messages))

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self.tokenizer, self.compile(constraint).grammar)


class Matcher:
    """One reply's place in its grammar: the mask of tokens allowed next, and the tokens taken."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._check()

    def bitmask(self) -> bytes:
        """Tokens allowed next: bit t of byte t // 8 (the model's end ids once complete).
        Raises GrammarError when the matcher failed (a parser limit passed, say)."""
        mask = self._matcher.compute_bitmask()
        self._check()
        return mask

    def copy(self) -> Matcher:
        """An independent matcher at the same place (to try tokens without moving this one)."""
        twin = Matcher.__new__(Matcher)
        twin._matcher = self._matcher.deep_copy()
        return twin

    def accept(self, token_id: int) -> None:
        """Take the sampled token; raises GrammarError if the grammar does not allow it."""
        self._matcher.consume_token(token_id)
        self._check()

    @property
    def is_finished(self) -> bool:
        """Nothing more may follow but an end token."""
        return self._matcher.is_stopped()

    @property
    def is_complete(self) -> bool:
        """What was taken so far satisfies the grammar."""
        return self._matcher.is_accepting()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
