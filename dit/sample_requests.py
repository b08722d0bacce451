"""The sampling queue: prompts from the command line and a prompts file, each a ``SampleRequest``.

    requests = build_queue(["a red ball"], "queue.jsonl", defaults)

A prompts file is plain text (one prompt a line), or ``.jsonl`` / ``.csv`` whose lines may each set
``prompt``, ``frames``, ``height``, ``width``, ``steps``, ``guidance``, ``guidance_2`` (two-expert
Wan2.2 A14B models: the low-noise expert's guidance), ``seed``,
``negative_prompt``, and for image-to-video models ``image`` and ``last_image`` (paths of PNG/JPEG
files); a field a line leaves out takes the command line's value (``defaults``). A
request's seed is its line's ``seed``, else the global seed plus its index in the queue, so its
noise never depends on where or with what it runs.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# field -> type a queue line gives it; a CSV cell is text and is converted with this type
FIELDS = {
    "prompt": str,
    "frames": int,
    "height": int,
    "width": int,
    "steps": int,
    "guidance": float,
    "guidance_2": float,
    "seed": int,
    "negative_prompt": str,
    "image": str,
    "last_image": str,
}


@dataclass(frozen=True)
class SampleRequest:
    """One clip to sample."""

    index: int  # position in the queue: names the output file and offsets the default seed
    prompt: str
    frames: int
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    negative_prompt: str = ""
    image: str = ""  # path of the first frame (image-to-video models); "" for none
    last_image: str = ""  # path of the last frame (FLF2V models)
    where: str = ""  # "queue.jsonl line 3" or "--prompt 1": what error messages name
    # guidance where a two-expert model (Wan2.2 A14B) runs its low-noise expert; None = guidance
    guidance_2: float | None = None

    @property
    def guided(self) -> bool:
        """Classifier-free guidance runs an unconditional branch; a scale of 1 does not need it."""
        return self.guidance != 1.0 or self.guidance_2 not in (None, 1.0)

    def label(self) -> str:
        return self.where or f"request {self.index}"

    def key(self, extra: str = "") -> str:
        """Six hex digits that change with anything that changes the clip (``extra``: the model and
        output settings), so a rerun skips only clips it would write identically."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("index", "where")}
        if fields["guidance_2"] is None:  # the keys of clips sampled before guidance_2 existed
            del fields["guidance_2"]
        for name in ("image", "last_image"):  # the frames' bytes, not only their names
            if fields[name] and Path(fields[name]).is_file():
                fields[name] += "@" + hashlib.sha256(Path(fields[name]).read_bytes()).hexdigest()
        text = json.dumps(fields, sort_keys=True) + extra
        return hashlib.sha256(text.encode()).hexdigest()[:6]


def _convert(name: str, value, where: str):
    kind = FIELDS[name]
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {name} must be text, got {value!r}")
        return value
    if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{where}: {name} must be {_a(kind)}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be {_a(kind)}, got {value!r}") from None


def _a(kind: type) -> str:
    return {int: "a whole number", float: "a number"}.get(kind, f"a {kind.__name__}")


def _fields(raw: dict, where: str) -> dict:
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; a line may set {', '.join(FIELDS)}")
    out = {k: _convert(k, v, where) for k, v in raw.items() if v is not None and v != ""}
    if not out.get("prompt", "").strip():
        raise ValueError(f'{where}: no prompt; every line needs a non-empty "prompt"')
    return out


def read_prompts_file(path: str | Path) -> list[tuple[str, dict]]:
    """-> (where, fields) per request of a prompts file, in order; ValueError naming the bad line."""
    path = Path(path)
    if not path.is_file():  # the flag named, not only the OS's words
        raise ValueError(f"--prompts-file {path}: no such file; pass a .txt, .jsonl or .csv queue")
    text = path.read_text()
    name = path.name
    if path.suffix == ".jsonl":
        lines = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{name} line {number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}: not a JSON object ({err.msg}); write one object per line"
                ) from None
            if not isinstance(raw, dict):
                raise ValueError(
                    f'{where}: not a JSON object; write one object per line, e.g. {{"prompt": "a cat"}}'
                )
            lines.append((where, _fields(raw, where)))
        return lines
    if path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames is None or "prompt" not in reader.fieldnames:
            raise ValueError(
                f"{name} line 1: a CSV queue needs a header row naming its columns, one of them prompt"
            )
        lines = []
        for row in reader:
            where = f"{name} line {reader.line_num}"
            if None in row or any(v is None for v in row.values()):
                raise ValueError(f"{where}: {len(reader.fieldnames)} columns expected (the header's)")
            lines.append((where, _fields(row, where)))
        return lines
    return [
        (f"{name} line {i}", {"prompt": line.strip()})
        for i, line in enumerate(text.splitlines(), 1)
        if line.strip()
    ]


def build_queue(prompts: list[str] | None, prompts_file: str | None, defaults: dict) -> list[SampleRequest]:
    """Requests of ``--prompt`` (in order) then of the prompts file. ``defaults`` gives every field but
    ``prompt``; ``seed`` there is the global seed that request i offsets by i."""
    entries = [(f"--prompt {i + 1}", {"prompt": p}) for i, p in enumerate(prompts or [])]
    if prompts_file:
        entries += read_prompts_file(prompts_file)
    if not entries:
        raise ValueError("no prompt given; pass --prompt TEXT (repeatable) or --prompts-file FILE")
    requests = []
    for index, (where, fields) in enumerate(entries):
        values = {**defaults, "seed": defaults["seed"] + index, **fields}
        if values["steps"] < 1:
            raise ValueError(f"{where}: steps={values['steps']} must be at least 1")
        requests.append(SampleRequest(index=index, where=where, **values))
    return requests
