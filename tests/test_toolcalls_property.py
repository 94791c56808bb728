"""Property test: reasoning + tool-call parsing of random documents split at random places.

A document is drawn as segments -- an optional think block, then content, valid calls
and malformed calls in any order -- rendered in one model family's syntax. The
reference is what the segments say: the calls in order, the reasoning text, and the
content (malformed calls verbatim; whitespace that only borders a valid call, and
Llama's ``;`` separators after one, dropped). The document is then fed to a
``ChoiceParser`` in random pieces, down to one character at a time; the content,
reasoning and reassembled calls must equal the reference. Since the parsers only ever
append, equality at the end also means no partial tag ever reached a client as content.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from app.choice_parser import ChoiceParser
from app.decoder import RequestDecoder
from app.messages import (
    FinishReason,
    OutputEvent,
    OutputKind,
    TokenDelta,
    TokenLogprob,
    ToolCallDelta,
)
from app.records import StopConditions

TAGS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
CHARS = [*'ab <>/{}[];\n\t_"|', "é", "日", "😀"]
FRAGMENTS = [
    "<tool",
    "<tool_call",
    "</tool_call>",
    "[TOOL",
    "[TOOL_CALLS",
    "<|python",
    "<|python_tag|",
    "<think",
    "</think",
    "[ARGS]",
    "{",
    "}",
    "\n\n",
    "  ",
]
RESERVED = ["<think>", "</think>", *TAGS.values()]

text = st.lists(st.sampled_from(CHARS + FRAGMENTS), max_size=8).map("".join)
json_leaf = st.one_of(
    st.integers(-5, 5), st.booleans(), st.none(), st.text(st.sampled_from([*CHARS, "\\"]))
)
arguments = st.dictionaries(
    st.text(st.sampled_from("abc_}"), max_size=4),
    st.one_of(json_leaf, st.lists(json_leaf, max_size=3)),
    max_size=3,
)
names = st.text(st.sampled_from("abcxyz_0123"), min_size=1, max_size=8)


def scrub(s: str) -> str:
    """Content never holds a whole tag (that would be a call or a think block)."""
    while any(tag in s for tag in RESERVED):
        for tag in RESERVED:
            s = s.replace(tag, "")
    return s


@dataclass
class Seg:
    kind: str  # "content", "call" (valid), "bad" (malformed, content verbatim)
    text: str
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()


def dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


@st.composite
def valid_call(draw: st.DrawFn, fmt: str, bare_ok: bool) -> Seg:
    n = draw(names)
    args = draw(arguments)
    ws = draw(st.sampled_from(["", " ", "\n"]))
    if fmt == "hermes":
        return Seg(
            "call",
            f"<tool_call>{ws}{dumps({'name': n, 'arguments': args})}{ws}</tool_call>",
            ((n, args),),
        )
    if fmt == "llama3_json":
        obj = dumps({"name": n, "parameters": args})
        tagged = not bare_ok or draw(st.booleans())
        return Seg("call", f"<|python_tag|>{ws}{obj}" if tagged else obj, ((n, args),))
    if draw(st.booleans()):
        return Seg("call", f"[TOOL_CALLS]{n}[ARGS]{dumps(args)}", ((n, args),))
    more = draw(st.lists(st.tuples(names, arguments), max_size=2))
    calls = ((n, args), *more)
    block = dumps([{"name": a, "arguments": b} for a, b in calls])
    return Seg("call", f"[TOOL_CALLS]{ws}{block}", calls)


BAD = {
    "hermes": [
        '<tool_call>{"name": 1}</tool_call>',
        "<tool_call>{oops</tool_call>",
        '<tool_call>{"arguments": {}}\n</tool_call>',
    ],
    "llama3_json": [
        '<|python_tag|>{"nam": "f"}',
        "<|python_tag|>f(x=1)",
        '<|python_tag|>{"name": "f", "parameters": [1]}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"nome": "f"}]',
        "[TOOL_CALLS]!",
        "[TOOL_CALLS]f[ARGS][1]",
        "[TOOL_CALLS] {}",
    ],
}
# Unfinished at the end of the output before its arguments opened: released as content
# at flush (a call cut inside its arguments was streamed, and stands: test_toolcalls.py).
CUT = {
    "hermes": '<tool_call>{"name": "f", "argu',
    "llama3_json": '<|python_tag|>{"name": "f", "param',
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {}}',
}


@st.composite
def documents(draw: st.DrawFn, fmt: str) -> list[Seg]:
    segs: list[Seg] = []
    bare_ok = True  # Llama: a bare JSON call may start here (start, or right after a call)
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["content", "content", "call", "bad"]))
        if kind == "call":
            segs.append(draw(valid_call(fmt, bare_ok)))
            bare_ok = True
            continue
        if kind == "bad":
            segs.append(Seg("bad", draw(st.sampled_from(BAD[fmt]))))
        elif segs and segs[-1].kind == "content":  # runs of content are one segment
            segs[-1] = Seg("content", scrub(segs[-1].text + draw(text)))
        else:
            segs.append(Seg("content", scrub(draw(text))))
        bare_ok = False
    if draw(st.booleans()):
        segs.append(Seg("bad", CUT[fmt]))
    elif fmt == "hermes" and draw(st.booleans()):
        # A last call left unclosed (EOS right after its JSON) still counts.
        n, args = draw(names), draw(arguments)
        segs.append(
            Seg("call", f"<tool_call>{dumps({'name': n, 'arguments': args})}\n", ((n, args),))
        )
    return unbare(segs, fmt)


def unbare(segs: list[Seg], fmt: str) -> list[Seg]:
    """Llama: content where a bare JSON call may start must not start with ``{``."""
    for i, seg in enumerate(segs):
        at_call_start = i == 0 or segs[i - 1].kind == "call"
        bare = fmt == "llama3_json" and seg.kind == "content" and at_call_start
        if bare and re.match(r"[\s;]*\{", seg.text):
            segs[i] = Seg("content", "x" + seg.text)
    return segs


def expected_content(segs: list[Seg], fmt: str) -> str:
    lead = re.compile(r"^[\s;]*") if fmt == "llama3_json" else re.compile(r"^\s*")
    out = []
    for i, seg in enumerate(segs):
        if seg.kind == "call":
            continue
        s = seg.text
        if seg.kind == "content":
            if i > 0 and segs[i - 1].kind == "call":
                s = lead.sub("", s)
            if i + 1 < len(segs) and segs[i + 1].kind == "call":
                s = s.rstrip()
        out.append(s)
    return "".join(out)


def run(parser: ChoiceParser, pieces: list[str]) -> tuple[str, str, list[ToolCallDelta]]:
    content = reasoning = ""
    calls: list[ToolCallDelta] = []
    for piece in pieces:
        c, r, k = parser.feed(piece, 1)
        content, reasoning, calls = content + c, reasoning + r, calls + (k or [])
    c, r, k = parser.flush()
    return content + c, reasoning + r, calls + (k or [])


def reassemble(deltas: list[ToolCallDelta]) -> list[tuple[str, dict[str, Any]]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.index == len(calls)
            assert d.id == f"call_{d.index:024x}" and d.name is not None
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments
    return [(n, json.loads(a)) for n, a in calls.values()]


@dataclass
class Drawn:
    """A drawn document and what it must parse to."""

    doc: str
    think: str  # "none", "block" (in the output) or "opened" (by the template)
    reasoning: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]


def draw_document(data: st.DataObject, fmt: str) -> Drawn:
    segs = data.draw(documents(fmt), label="segments")
    think = data.draw(st.sampled_from(["none", "block", "opened"]), label="think")
    thought = scrub(data.draw(text, label="reasoning"))
    if think != "none" and segs and segs[0].kind == "content":
        # The reasoning parser drops whitespace after </think>: strip it here too.
        segs[0] = Seg("content", segs[0].text.lstrip())
        segs = unbare(segs, fmt)
    if think == "none" and segs and segs[0].kind == "content":
        # Without a block, a leading "<think" fragment must not open one.
        segs[0] = Seg("content", "x" + segs[0].text)
    body = "".join(s.text for s in segs)
    prelude = {"none": "", "block": f"\n<think>{thought}</think>\n", "opened": f"{thought}</think>"}
    return Drawn(
        doc=prelude[think] + body,
        think=think,
        reasoning="" if think == "none" else thought.lstrip(),
        content=expected_content(segs, fmt),
        calls=[call for s in segs if s.kind == "call" for call in s.calls],
    )


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers):024x}"


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), fmt=st.sampled_from(sorted(TAGS)))
def test_split_documents_parse_as_their_segments(data: st.DataObject, fmt: str) -> None:
    want = draw_document(data, fmt)
    doc = want.doc
    if data.draw(st.booleans(), label="one character at a time"):
        cuts = list(range(1, len(doc)))
    else:
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(doc) - 1, 1))), label="cuts"))
    pieces = [doc[a:b] for a, b in zip([0, *cuts], [*cuts, len(doc)], strict=True)]

    parser = ChoiceParser(
        reasoning_parser="think",
        start_in_reasoning=want.think == "opened",
        tool_parser=fmt,
        new_id=counter_ids(),
    )
    content, reasoning, deltas = run(parser, pieces)
    event(f"{fmt}: calls {min(len(want.calls), 2)}, think {want.think}")
    assert reassemble(deltas) == want.calls
    assert parser.calls == len(want.calls)
    assert reasoning == want.reasoning
    assert content == want.content


PROMPT = "<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n"
EOS = 2


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), fmt=st.sampled_from(sorted(TAGS)))
def test_token_stream_through_the_request_decoder(
    smollm_tokenizer: Tokenizer, data: st.DataObject, fmt: str
) -> None:
    """The same documents as SmolLM2 tokens, in random groups, through the
    RequestDecoder with logprobs: the parse is the same, every token's logprob rides on
    the DELTA of its group, and the finish says whether tools were called."""
    tok = smollm_tokenizer
    want = draw_document(data, fmt)
    ids = tok.encode(want.doc).ids
    assert tok.decode(ids) == want.doc  # byte-level BPE round-trips exactly
    ids.append(EOS)
    every = st.sets(st.integers(1, len(ids) - 1)) if len(ids) > 1 else st.just(set[int]())
    cuts = sorted(data.draw(every, label="cuts"))
    groups = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
    prompt = PROMPT + ("<think>\n" if want.think == "opened" else "")
    req = RequestDecoder(
        tok,
        tok.encode(prompt).ids,
        StopConditions(eos_token_ids=(EOS,)),
        logprobs=True,
        tool_parser=fmt,
        tools_enabled=True,
        reasoning_parser="think",
        new_call_id=counter_ids(),
    )
    content = reasoning = ""
    deltas: list[ToolCallDelta] = []
    finals: list[OutputEvent] = []
    for group in groups:
        events = req.feed(TokenDelta(0, group, logprobs=[TokenLogprob(i, -1.0, []) for i in group]))
        (delta,) = [e for e in events if e.kind is OutputKind.DELTA]
        assert [lp.token_id for lp in delta.logprobs or []] == group
        content += delta.text
        reasoning += delta.reasoning
        deltas += delta.tool_calls or []
        finals += [e for e in events if e.kind is OutputKind.FINAL]
    assert reassemble(deltas) == want.calls
    assert (content, reasoning) == (want.content, want.reasoning)
    (fin,) = finals
    assert fin.finish_reason is (FinishReason.TOOL_CALLS if want.calls else FinishReason.STOP)
    reasoning_tokens = req.usage["completion_tokens_details"]["reasoning_tokens"]
    assert (reasoning_tokens > 0) is (want.think != "none")
