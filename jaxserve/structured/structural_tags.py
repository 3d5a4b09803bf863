"""Structural tags: text that is free except where the request says what must come, as xgrammar
defines them and vLLM and SGLang take them (`response_format: {"type": "structural_tag", ...}`,
SGLang's `sampling_params.structural_tag`). Two forms:

- the first one: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free text, and
  where the output writes a trigger, one of the structures whose begin starts with it;
- xgrammar's format tree, `{"format": {"type": ...}}`, of which this module takes the string-level
  formats: `const_string`, `json_schema` (style "json"), `grammar`, `regex`, `any_text`,
  `sequence`, `or`, `optional`, `plus`, `star`, `repeat`, `tag`, `triggered_tags` and
  `tags_with_separator`. The token-level formats, `dispatch`, the XML argument styles, `any_order`
  and `any_text`'s budgets are refused by name.

The first form is the second's `triggered_tags`, so both are written the same way: as Lark rules
for llguidance (`lark`), which the structured-output compiler validates and caches.

Where a format has no end of its own (`any_text`, and `triggered_tags` unless it stops after one
required tag), what follows it decides where it ends: the end of the output, or the end string of
the tag it is the content of (one lexeme runs from the text through that end, as xgrammar stops
such a format at its tag's end). Anywhere else it could never end, and is refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.structured.spec import GuideError

MAX_STRUCTURES = 256  # the first form's structures
MAX_NODES = 4096  # format objects in one tree
MAX_REPEAT = 1024
_KEYS: dict[str, tuple[set[str], set[str]]] = {  # type -> (required keys, optional keys), besides "type"
    "const_string": ({"value"}, set()),
    "json_schema": ({"json_schema"}, {"style", "any_order"}),
    "grammar": ({"grammar"}, set()),
    "regex": ({"pattern"}, set()),
    "any_text": (set(), {"excludes", "max_tokens", "max_chars"}),
    "sequence": ({"elements"}, set()),
    "or": ({"elements"}, set()),
    "optional": ({"content"}, set()),
    "plus": ({"content"}, set()),
    "star": ({"content"}, set()),
    "repeat": ({"content", "min", "max"}, set()),
    "tag": ({"begin", "content", "end"}, set()),
    "triggered_tags": ({"triggers", "tags"}, {"at_least_one", "stop_after_first", "excludes"}),
    "tags_with_separator": ({"tags", "separator"}, {"at_least_one", "stop_after_first"}),
}
_NOT_YET = {"dispatch", "token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch"}


# ---- checking -------------------------------------------------------------------------------------
def check(value: dict[str, Any], param: str) -> dict[str, Any]:
    """A structural tag in its canonical form (the first form becomes a `triggered_tags` format),
    every schema, regex and grammar in it checked; GuideError naming where a problem is."""
    if "format" in value:
        unknown = sorted(set(value) - {"type", "format"})
        if unknown:
            raise GuideError(param, f"unknown key(s) {unknown}; a structural tag has a format")
        counter = [0]
        node = _check(value["format"], f"{param}.format", counter)
        _Writer("check").root(node, f"{param}.format")  # a format that could never end is refused now
        return {"format": node}
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown:
        raise GuideError(param, f"unknown key(s) {unknown}; a structural tag has structures and triggers (or a "
                         "format)")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GuideError(param, "triggers: expected a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures or len(structures) > MAX_STRUCTURES:
        raise GuideError(param, f"structures: expected a list of 1 to {MAX_STRUCTURES} {{begin, schema, end}} "
                         "objects")
    from jaxserve.structured.spec import json_schema

    tags = []
    for i, s in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or not s["begin"]:
            raise GuideError(where, "expected {\"begin\": non-empty string, \"schema\": JSON schema, "
                             "\"end\": string}")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise GuideError(where, f"begin {s['begin']!r} starts with none of the triggers {triggers}")
        schema = json.loads(json_schema(s.get("schema", {}), f"{where}.schema").text)
        tags.append({"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": schema},
                     "end": [s["end"]]})
    return {"format": {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": False,
                       "stop_after_first": False, "excludes": []}}


def _check(node: Any, where: str, counter: list[int]) -> dict[str, Any]:
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise GuideError(where, f"a structural tag may hold at most {MAX_NODES} format objects")
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise GuideError(where, "expected a format object with a type")
    kind = node["type"]
    if kind in _NOT_YET:
        raise GuideError(where, f"the {kind!r} format is not supported yet (token-level formats and dispatch); the "
                         f"string-level ones are {', '.join(_KEYS)}")
    if kind not in _KEYS:
        raise GuideError(where, f"unknown format type {kind!r}; expected one of {', '.join(_KEYS)}")
    required, optional = _KEYS[kind]
    missing, unknown = sorted(required - set(node)), sorted(set(node) - required - optional - {"type"})
    if missing or unknown:
        raise GuideError(where, f"a {kind} format has {', '.join(sorted(required)) or 'no required keys'}"
                         + (f" (and optionally {', '.join(sorted(optional))})" if optional else "")
                         + f"; {'missing ' + str(missing) if missing else 'unknown ' + str(unknown)}")
    from jaxserve.structured import spec as specs

    out: dict[str, Any] = {"type": kind}
    if kind == "const_string":
        out["value"] = _string(node["value"], f"{where}.value")
    elif kind == "json_schema":
        if node.get("style", "json") != "json":
            raise GuideError(f"{where}.style", f"only \"json\" is supported yet, got {node['style']!r}")
        if node.get("any_order"):
            raise GuideError(f"{where}.any_order", "not supported yet: properties come in their schema's order")
        out["json_schema"] = json.loads(specs.json_schema(node["json_schema"], f"{where}.json_schema").text)
    elif kind == "grammar":
        out["grammar"] = specs.grammar(node["grammar"], f"{where}.grammar").text
    elif kind == "regex":
        pattern = _string(node["pattern"], f"{where}.pattern")
        try:
            re.compile(pattern)
        except re.error as e:
            raise GuideError(f"{where}.pattern", f"invalid regex: {e}") from None
        out["pattern"] = pattern
    elif kind == "any_text":
        for budget in ("max_tokens", "max_chars"):
            if node.get(budget) is not None:
                raise GuideError(f"{where}.{budget}", "not supported yet (a budget on free text); the text ends at "
                                 "its tag's end or the output's")
        out["excludes"] = _strings(node.get("excludes", []), f"{where}.excludes", allow_empty_list=True)
    elif kind in ("sequence", "or"):
        elements = node["elements"]
        if not isinstance(elements, list) or not elements:
            raise GuideError(f"{where}.elements", "expected a non-empty list of formats")
        out["elements"] = [_check(e, f"{where}.elements[{i}]", counter) for i, e in enumerate(elements)]
    elif kind in ("optional", "plus", "star"):
        out["content"] = _check(node["content"], f"{where}.content", counter)
    elif kind == "repeat":
        lo, hi = node["min"], node["max"]
        if not _is_int(lo) or not _is_int(hi) or lo < 0 or hi == 0 or hi < -1 or (hi != -1 and hi < lo) \
                or max(lo, hi) > MAX_REPEAT:
            raise GuideError(where, f"min and max: integers with 0 <= min <= max, 1 <= max <= {MAX_REPEAT} (max -1: "
                             f"no bound), got {lo!r} and {hi!r}")
        out.update(min=lo, max=hi, content=_check(node["content"], f"{where}.content", counter))
    elif kind == "tag":
        out.update(_tag(node, where, counter))
    else:  # triggered_tags, tags_with_separator
        tags = node["tags"]
        if not isinstance(tags, list) or not tags:
            raise GuideError(f"{where}.tags", "expected a non-empty list of tag formats")
        out["tags"] = []
        for i, t in enumerate(tags):
            if not isinstance(t, dict) or t.get("type") != "tag":
                raise GuideError(f"{where}.tags[{i}]", "expected a tag format ({\"type\": \"tag\", ...})")
            out["tags"].append(_check(t, f"{where}.tags[{i}]", counter))
        for flag in ("at_least_one", "stop_after_first"):
            if not isinstance(node.get(flag, False), bool):
                raise GuideError(f"{where}.{flag}", "expected true or false")
            out[flag] = node.get(flag, False)
        if kind == "tags_with_separator":
            if not isinstance(node["separator"], str):
                raise GuideError(f"{where}.separator", "expected a string")
            out["separator"] = node["separator"]
        else:
            out["triggers"] = _strings(node["triggers"], f"{where}.triggers")
            out["excludes"] = _strings(node.get("excludes", []), f"{where}.excludes", allow_empty_list=True)
            for i, t in enumerate(out["tags"]):
                if not any(t["begin"].startswith(trigger) for trigger in out["triggers"]):
                    raise GuideError(f"{where}.tags[{i}].begin", f"{t['begin']!r} starts with none of the triggers "
                                     f"{out['triggers']}")
    return out


def _tag(node: dict[str, Any], where: str, counter: list[int]) -> dict[str, Any]:
    begin, end = node["begin"], node["end"]
    if not isinstance(begin, str) or not begin:
        raise GuideError(f"{where}.begin", "expected a non-empty string (token begins are not supported yet)")
    ends = [end] if isinstance(end, str) else end
    if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
        raise GuideError(f"{where}.end", "expected a string or a non-empty list of strings (token ends are not "
                         "supported yet)")
    if "" in ends and len(ends) > 1:
        raise GuideError(f"{where}.end", "an empty end cannot be one of several")
    return {"begin": begin, "content": _check(node["content"], f"{where}.content", counter), "end": ends}


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise GuideError(where, "expected a non-empty string")
    return value


def _strings(value: Any, where: str, allow_empty_list: bool = False) -> list[str]:
    if not isinstance(value, list) or (not value and not allow_empty_list) \
            or not all(isinstance(s, str) and s for s in value):
        raise GuideError(where, "expected a " + ("" if allow_empty_list else "non-empty ") + "list of non-empty "
                         "strings")
    return list(value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- writing Lark ---------------------------------------------------------------------------------
_ANY = "(?s:.*)"
_EOS = "eos"  # the context of a format the output's end follows


def lark(tag: dict[str, Any], name: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Lark lines defining rule `name` as the checked structural tag `tag` (check's output), and the
    side grammars (user grammars) they reference."""
    writer = _Writer(name)
    writer.lines.insert(0, f"{name}: {writer.root(tag['format'], name)}")
    return writer.lines, writer.side


class _Writer:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.lines: list[str] = []
        self.side: list[dict[str, Any]] = []
        self.count = 0

    def root(self, node: dict[str, Any], where: str) -> str:
        return self.expr(node, _EOS, where)[0]

    def _fresh(self, kind: str, terminal: bool = False) -> str:
        self.count += 1
        name = f"{self.prefix}_{kind}_{self.count}"
        return name.upper() if terminal else name

    def _rule(self, body: str, kind: str) -> str:
        name = self._fresh(kind)
        self.lines.append(f"{name}: {body}")
        return name

    def _terminal(self, regex: str, kind: str) -> str:
        name = self._fresh(kind, terminal=True)
        self.lines.append(f"{name}: {regex}")
        return name

    def expr(self, node: dict[str, Any], follow: Any, where: str) -> tuple[str, bool]:
        """(a Lark expression for `node`, whether it took the end strings that follow it).
        follow: _EOS (the output ends after it), a list of end strings (its tag's end comes next;
        an unbounded format takes it into its last lexeme), or None (something else comes next)."""
        from jaxserve.structured.compose import json_rule

        kind = node["type"]
        if kind == "const_string":
            return json.dumps(node["value"]), False
        if kind == "json_schema":
            return self._rule(json_rule(node["json_schema"]), "json"), False
        if kind == "regex":
            return self._terminal("/" + slashes_escaped(node["pattern"]) + "/", "re"), False
        if kind == "grammar":
            from jaxserve.structured.spec import as_lark

            grammar = self._fresh("grammar")
            self.side.append({"name": grammar, "lark_grammar": as_lark(node["grammar"], f"{where}.grammar")})
            return f"@{grammar}", False
        if kind == "any_text":
            return self._text(node["excludes"], [], follow, where, "any_text"), follow != _EOS
        if kind == "sequence":
            parts = [self.expr(e, None, f"{where}.elements[{i}]")[0] for i, e in enumerate(node["elements"][:-1])]
            last, took = self.expr(node["elements"][-1], follow, f"{where}.elements[{len(parts)}]")
            return "(" + " ".join(parts + [last]) + ")", took
        if kind == "or":
            # Each alternative ends where the or does: one that takes the tag's end is followed
            # by nothing, the others by that end.
            alternatives = [self.expr(e, follow, f"{where}.elements[{i}]") for i, e in enumerate(node["elements"])]
            return self._ended(alternatives, follow)
        if kind == "optional":
            content, took = self.expr(node["content"], follow, f"{where}.content")
            if isinstance(follow, list) and took:  # the content, or nothing before the end
                return self._ended([(content, True), ("", False)], follow)
            return f"({content})?", False
        if kind in ("plus", "star"):
            inner = self.expr(node["content"], None, f"{where}.content")[0]
            return f"({inner}){ {'plus': '+', 'star': '*'}[kind]}", False
        if kind == "repeat":
            inner = self.expr(node["content"], None, f"{where}.content")[0]
            lo, hi = node["min"], node["max"]
            if hi == -1:
                return (f"({inner}) ~ {lo} ({inner})*" if lo else f"({inner})*"), False
            return f"({inner}) ~ {lo}..{hi}", False
        if kind == "tag":
            return self._tag(node, node["begin"], where), False
        if kind == "tags_with_separator":
            one = "(" + " | ".join(self._tag(t, t["begin"], f"{where}.tags[{i}]")
                                   for i, t in enumerate(node["tags"])) + ")"
            if node["stop_after_first"]:
                return (one if node["at_least_one"] else f"{one}?"), False
            more = f"({json.dumps(node['separator'])} {one})*" if node["separator"] else f"{one}*"
            return (f"{one} {more}" if node["at_least_one"] else f"({one} {more})?"), False
        return self._triggered(node, follow, where)

    @staticmethod
    def _ended(alternatives: list[tuple[str, bool]], follow: Any) -> tuple[str, bool]:
        """Alternatives as one expression: where `follow` is a tag's end strings and any of them
        took it, the others get it appended, and the whole took it."""
        if not isinstance(follow, list) or not any(took for _, took in alternatives):
            return "(" + " | ".join(e for e, _ in alternatives) + ")", False
        end = _one_of(follow)
        return "(" + " | ".join(e if took else f"{e} {end}".strip() for e, took in alternatives) + ")", True

    def _tag(self, tag: dict[str, Any], begin: str, where: str) -> str:
        """begin (the part of it not yet written), content, end."""
        ends = [e for e in tag["end"] if e]
        content, took = self.expr(tag["content"], ends or None, f"{where}.content")
        parts = [json.dumps(begin)] if begin else []
        parts.append(content)
        if ends and not took:
            parts.append(_one_of(ends))
        return self._rule(" ".join(parts), "tag")

    def _text(self, excludes: list[str], triggers: list[str], follow: Any, where: str, what: str) -> str:
        """A lexeme of free text holding none of `excludes` and `triggers`, and, when `follow` is a
        tag's end strings, running through the first of them."""
        if follow is None:
            raise GuideError(where, f"{what} has no end of its own: it must be the last of the output or of a tag's "
                             "content (whose end then ends it)")
        banned = "|".join(regex_literal(s) for s in [*excludes, *triggers])
        if follow == _EOS:
            regex = f"/{_ANY}/" + (f" & ~/{_ANY}(?:{banned}){_ANY}/" if banned else "")
        else:
            ends = "|".join(regex_literal(e) for e in follow)
            # The text, then the first end string written: nothing may follow that end in the lexeme.
            regex = f"/{_ANY}(?:{ends})/ & ~/{_ANY}(?:{ends})(?s:.+)/"
            if banned:
                regex += f" & ~/{_ANY}(?:{banned}){_ANY}(?:{ends})/"
        # Free text outside any tag is named *_TEXT_<n> (compose keeps a reasoning model's answer
        # text from opening a think block); inside a tag, *_TAGTEXT_<n>.
        return self._terminal(regex, "text" if follow == _EOS else "tagtext")

    def _triggered(self, node: dict[str, Any], follow: Any, where: str) -> tuple[str, bool]:
        """Free text; where a trigger is written (a lazy lexeme ending at it), one of the tags whose
        begin starts with it; then free text again. at_least_one: a tag first, no text before it;
        stop_after_first: nothing after the first tag."""
        triggers, tags = node["triggers"], node["tags"]
        first_only, required = node["stop_after_first"], node["at_least_one"]
        if required and first_only:  # exactly one tag: bounded
            return "(" + " | ".join(self._tag(t, t["begin"], f"{where}.tags[{i}]")
                                    for i, t in enumerate(tags)) + ")", False
        tail = self._text(node["excludes"], triggers, follow, where, "triggered_tags")
        # The text before a trigger: free of triggers, excludes and the enclosing end.
        ends = [] if follow == _EOS else follow
        head_text = self._terminal(f"/{_ANY}/ & ~/{_ANY}(?:"
                                   + "|".join(regex_literal(s) for s in [*node["excludes"], *triggers, *ends])
                                   + f"){_ANY}/", "text" if follow == _EOS else "tagtext")
        parts = []
        for i, trigger in enumerate(triggers):
            bodies = [self._tag(t, t["begin"][len(trigger):], f"{where}.tags[{k}]")
                      for k, t in enumerate(tags) if t["begin"].startswith(trigger)]
            if bodies:  # (a trigger that begins no tag can only be refused text)
                head = self._fresh("head")
                self.lines.append(f"{head}[lazy]: {head_text} {json.dumps(trigger)}")
                parts.append(f"{head} ({' | '.join(bodies)})")
        part = "(" + " | ".join(parts) + ")"
        end = "" if follow == _EOS else " " + _one_of(follow)
        if first_only:
            return f"({tail} | {part}{end})", follow != _EOS
        if required:
            first = "(" + " | ".join(self._tag(t, t["begin"], f"{where}.tags[{i}]") for i, t in enumerate(tags)) + ")"
            return f"{first} {part}* {tail}", follow != _EOS
        return f"{part}* {tail}", follow != _EOS


def _one_of(strings: list[str]) -> str:
    """Lark: any one of these literal strings."""
    return "(" + " | ".join(json.dumps(s) for s in strings) + ")"


def regex_literal(text: str) -> str:
    """`text` matched literally inside Lark's /.../ (Rust regex syntax: punctuation escaped)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def slashes_escaped(regex: str) -> str:
    """The regex inside Lark's /.../: a bare slash would end it (an escaped one stays as it is)."""
    out, escaped = [], False
    for c in regex:
        out.append("\\/" if c == "/" and not escaped else c)
        escaped = c == "\\" and not escaped
    return "".join(out)
