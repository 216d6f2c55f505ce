"""How a model pools by default, read from its sentence-transformers files where it has them.

A sentence-transformers directory says its pipeline in `modules.json` (Transformer, Pooling,
Dense, Normalize, ...) and its pooling in `1_Pooling/config.json` (`pooling_mode_mean_tokens`, ...);
`config.json` may say the model was trained for shorter vectors (`is_matryoshka`,
`matryoshka_dimensions`, vLLM's keys). A model without them pools as vLLM's decoder embedding
models do: the last token, normalized. Modules quill does not run (Dense projections on
causal models: their mean is summed chunk by chunk in the engine) are named, so that the server
refuses embeddings instead of returning vectors the model's users would not get; an encoder's
Dense projections (EmbeddingGemma's) run after its pooling (quill/model/pooled_head.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from quill.contract.errors import InvalidRequestError
from quill.contract.pooling import PoolingParams

# sentence-transformers' pooling modes, as quill's.
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
          "pooling_mode_lasttoken": "last"}  # fmt: skip
_RUN = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    type: str = "last"
    normalize: bool = True
    # The vector lengths `dimensions` may ask for: True any, a tuple those, False none.
    matryoshka: bool | tuple[int, ...] = False
    unsupported: list[str] = field(default_factory=list)  # modules quill does not run
    width: int | None = None  # the hidden size: the vector's full length

    @classmethod
    def read(cls, model_path: str | Path, encoder: bool = False) -> PoolingConfig:
        """`encoder`: the model pools each prompt whole (quill/model/pooled_head.py runs its
        Dense modules)."""
        root = Path(model_path)
        if not root.is_dir():
            return cls()
        config = _json(root / "config.json") or {}
        matryoshka: bool | tuple[int, ...] = bool(config.get("is_matryoshka"))
        if config.get("matryoshka_dimensions"):
            matryoshka = tuple(config["matryoshka_dimensions"])
        modules = _json(root / "modules.json")
        width = config.get("hidden_size")
        if modules is None:
            return cls(matryoshka=matryoshka, width=width)
        kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        runs = (*_RUN, "Dense") if encoder else _RUN
        unsupported = [k for k in kinds if k not in runs]
        kind = "last"
        for m in modules:
            if m.get("type", "").endswith("Pooling"):
                pooling = _json(root / m.get("path", "") / "config.json") or {}
                chosen = [v for k, v in _MODES.items() if pooling.get(k)]
                others = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v
                          and k not in _MODES]  # fmt: skip
                unsupported += others
                if chosen:
                    kind = chosen[0]
        return cls(kind, "Normalize" in kinds, matryoshka, unsupported, width)

    def params(self, dimensions: int | None, normalize: bool | None) -> PoolingParams:
        """The pooling a request gets: the model's, with its own `dimensions` (where the
        model was trained for them) and `normalize` (vLLM's field) over the defaults."""
        if self.unsupported:
            raise InvalidRequestError(
                "this model's sentence-transformers pipeline has modules quill does not run "
                f"({', '.join(self.unsupported)}): its embeddings would not be the model's",
                "model",
            )
        if dimensions is not None:
            if not self.matryoshka:
                raise InvalidRequestError("this model does not support dimensions (it was not "
                                          "trained for shorter vectors)", "dimensions")  # fmt: skip
            allowed = self.matryoshka if isinstance(self.matryoshka, tuple) else None
            too_long = self.width is not None and dimensions > self.width
            if too_long or (allowed is not None and dimensions not in allowed):
                raise InvalidRequestError(
                    f"dimensions must be one of {list(allowed)}" if allowed
                    else f"dimensions must be at most {self.width}", "dimensions"
                )  # fmt: skip
        return PoolingParams(self.type, self.normalize if normalize is None else normalize,
                             dimensions)  # fmt: skip


def _json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
