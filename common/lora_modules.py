"""``--lora-modules``: the LoRA adapters an engine serves and a router names, read as vLLM reads the flag
(the router reads it too, without importing torch)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from common.cli import json_object


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry, as vLLM reads it: ``name=path``, or a JSON object with ``name``,
    ``path`` and optionally ``base_model_name`` (the base model the adapter's model card names; the
    served model's name where not given)."""

    name: str
    path: str
    base_model_name: str | None = None

    def to_arg(self) -> str:
        """This entry as the flag's JSON form, its path absolute (for a child process's flags)."""
        path = str(Path(self.path).expanduser().resolve())
        return json.dumps({"name": self.name, "path": path, "base_model_name": self.base_model_name})

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """From the flag's text; ``ValueError`` naming what is wrong."""
        text = text.strip()
        if text.startswith("{"):
            value = json_object(text, "--lora-modules")
            unknown = sorted(set(value) - {"name", "path", "base_model_name"})
            if unknown:
                raise ValueError(f"--lora-modules: field(s) {', '.join(unknown)} not implemented "
                                 "(name, path, base_model_name)")
            name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
            if base is not None and not isinstance(base, str):
                raise ValueError("--lora-modules: base_model_name must be a string")
        else:
            name, sep, path = text.partition("=")
            base = None
            if not sep:
                raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON object")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {text!r} needs a name and a path")
        return cls(name, path, base)


def lora_module_arg(text: str) -> LoRAModule:
    """``--lora-modules``' type: refused at parse time (exit 2, the reason named)."""
    try:
        return LoRAModule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
