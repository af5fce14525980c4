"""The C core's ``policy.h``, generated from the Python core's tables at build time.

Strategy: the Python core is the specification, so the C core (unikernel/src/core.c)
retypes none of it: this module renders, in the way h2o's ``misc/tokens.pl`` writes
its token tables, everything the C side would otherwise copy by hand — the methods,
error pages and fatal statuses (``core/policy.py``), the limits the kernel takes and
their command-line names (``policy.LIMITS`` with ``kernel``), the token characters
and request fields the parser reads (``core/request.py``), the coding bits and the
tokens naming them (``core/site.py``, ``core/negotiate.py``), the saturation bounds
of numbers (``negotiate.RANGE_MAX``, ``dates.YEAR_MAX``), the bounds of several ranges
(``ranges.py``), the bytes a Location keeps (``matcher.LOCATION_SAFE``), the TLS
layer's answer to a plain HTTP request on its port (``protocols/tls.py``), and the site image's record
layouts (``layout.RECORDS``) as C structs whose sizes and offsets are asserted at
compile time. ``kernel.link`` writes it into the kernel's object directory before
``make``; by hand: ``python -m orisha.targets.unikernel.policy_header OUTDIR``.
"""

from __future__ import annotations

import os
import sys

from ...core import dates, matcher, negotiate, policy, ranges, request, site
from ...errors import BuildError
from ...protocols import tls
from . import layout

NAME = "policy.h"


def _c_name(token: bytes) -> str:
    return token.decode().upper().replace("-", "_")


def _strings(items) -> str:
    return ", ".join('"%s"' % i.decode() for i in items)


def _methods_and_statuses() -> list[str]:
    fatal = sorted(policy.FATAL)
    return [
        "/* RFC 9110 §9.3: served; known but not performed (405 with Allow); any other 501. */",
        f"static const char *const policy_safe_methods[] = {{ {_strings(policy.SAFE_METHODS)} }};",
        f"static const char *const policy_known_methods[] = {{ {_strings(policy.KNOWN_METHODS)} }};",
        "/* The built-in error pages every image carries (connection.ERRORS). */",
        "static const uint16_t policy_error_pages[] = { %s };"
        % ", ".join(map(str, policy.ERROR_PAGES)),
        "/* After these the request stream cannot be framed: close and drop the rest. */",
        "static const uint16_t policy_fatal[] = { %s };" % ", ".join(map(str, fatal)),
        "/* The Sec-Fetch-Dest values the SPA fallback answers (policy.NAVIGATION_DESTS). */",
        "static const char *const policy_navigation_dests[] = { %s };"
        % _strings(policy.NAVIGATION_DESTS),
        "/* Milliseconds a finished connection drains input for the peer's EOF (policy.LINGER). */",
        f"#define POLICY_LINGER_MS {round(policy.LINGER * 1000)}ull",
        "/* The most cores `orisha boot --cpus` gives the image (policy.RANGES['cpus']): the",
        " * size of the kernel's per-core tables; orisha.cpus=N on the command line. */",
        f"#define POLICY_CPUS_MAX {policy.RANGES['cpus'].high}",
    ]


def _limits() -> list[str]:
    """X(name, default, scale): ``orisha.<name>=<value>`` on the kernel command line; the
    core holds value x scale (limits in seconds, the Python floats, as milliseconds)."""
    rows, ranges, defaults = [], [], []
    for limit in policy.LIMITS:
        if not limit.kernel:
            continue
        scale = 1000 if isinstance(limit.default, float) else 1
        default = round(limit.default * scale)
        rows.append(f"    X({limit.attr}, {default}ull, {scale})")
        low, high = limit.range.low, limit.range.high
        ranges.append(f"    X({limit.attr}, {round(low * scale)}ull, {round(high * scale)}ull)")
        defaults.append(f"#define POLICY_DEFAULT_{limit.attr.upper()} {default}ull")
    return ["/* The limits the kernel takes (policy.LIMITS): X(name, default, scale), read",
            " * from orisha.<name>=<value> on the command line and held as value x scale",
            " * (seconds as milliseconds). */",
            "#define POLICY_LIMITS(X) \\", " \\\n".join(rows),
            "/* Their valid values (policy.LIMITS' ranges), scaled alike: X(name, low, high);",
            " * a value outside is ignored with a line on the console, as `orisha boot`",
            " * refuses it. */",
            "#define POLICY_LIMIT_RANGES(X) \\", " \\\n".join(ranges), *defaults]


def _grammar() -> list[str]:
    table = [1 if ch in request.TCHARS else 0 for ch in range(256)]
    rows = [", ".join(map(str, table[i:i + 32])) for i in range(0, 256, 32)]
    single, listed = request.SINGLE_FIELDS, request.LIST_FIELDS
    names = [f"FIELD_{_c_name(n)}" for n in single + listed]
    enum = names[:len(single)] + [f"FIELD_SINGLE_N, {names[len(single)]} = FIELD_SINGLE_N"] \
        + names[len(single) + 1:] + ["FIELD_N"]
    return [
        "/* RFC 9110 §5.6.2 tchar (request.TCHARS), by byte. */",
        "static const uint8_t policy_tchar[256] = {", *(f"    {r}," for r in rows), "};",
        "/* The request fields the core reads: single ones keep one value, list ones are",
        " * joined (request.SINGLE_FIELDS, request.LIST_FIELDS). */",
        "enum policy_field {", *(f"    {e}," for e in enum), "};",
        "static const char *const policy_field_names[FIELD_N] = {",
        *(f'    "{n.decode()}",' for n in single + listed), "};",
        "/* 1*DIGIT numbers saturate here (negotiate.RANGE_MAX, dates.YEAR_MAX). */",
        f"#define POLICY_RANGE_MAX {negotiate.RANGE_MAX}ull",
        f"#define POLICY_YEAR_MAX {dates.YEAR_MAX}ull",
    ]


def _ranges_and_rules() -> list[str]:
    table = [1 if ch in matcher.LOCATION_SAFE else 0 for ch in range(256)]
    rows = [", ".join(map(str, table[i:i + 32])) for i in range(0, 256, 32)]
    return [
        "/* Several ranges (ranges.py): merged when closer than GAP bytes; more than PARTS_MAX",
        " * parts or BYTES_MAX bytes are answered whole; a position of more than DIGITS",
        " * digits (leading zeros aside) counts as BIG. */",
        f"#define POLICY_RANGE_GAP {ranges.GAP}ull",
        f"#define POLICY_RANGE_PARTS_MAX {ranges.MAX_PARTS}",
        f"#define POLICY_RANGE_BYTES_MAX {ranges.MAX_BYTES}ull",
        f"#define POLICY_RANGE_DIGITS {ranges.DIGITS}",
        f"#define POLICY_RANGE_BIG {ranges.BIG}ull",
        "/* The bytes a rule's capture keeps in a Location; the rest is percent-encoded",
        " * (matcher.LOCATION_SAFE). */",
        "static const uint8_t policy_location_safe[256] = {", *(f"    {r}," for r in rows), "};",
    ]


def _c_bytes(data: bytes) -> str:
    """A C string literal of DATA (octal escapes: fixed width, so no digit after one
    can extend it)."""
    return '"%s"' % "".join(chr(b) if 0x20 <= b < 0x7F and b not in b'"\\?' else f"\\{b:03o}"
                            for b in data)


def _tls_plain() -> list[str]:
    first = tls.PLAIN_FIRST
    assert first.step == 1
    return ["/* A plain HTTP request on the TLS port (protocols/tls.py): a first byte in",
            " * [FIRST_MIN, FIRST_MAX] (an uppercase method letter, no TLS record type) is",
            " * answered in plain text, head, the Date/close tail, body, and the connection",
            " * closes (PLAIN_FIRST, PLAIN_400_HEAD, PLAIN_400_BODY). */",
            f"#define POLICY_TLS_PLAIN_FIRST_MIN {first.start:#x}",
            f"#define POLICY_TLS_PLAIN_FIRST_MAX {first.stop - 1:#x}",
            f"static const char policy_tls_plain_head[] = {_c_bytes(tls.PLAIN_400_HEAD)};",
            f"static const char policy_tls_plain_body[] = {_c_bytes(tls.PLAIN_400_BODY)};"]


def _codings() -> list[str]:
    lines = ["/* Content-coding bits of an Accept-Encoding mask (site.CODING_BITS) and the",
             " * tokens that name them (negotiate.CODING_TOKENS). */"]
    lines += [f"#define CODING_{_c_name(n)} {bit}" for n, bit in site.CODING_BITS.items()]
    lines += ["static const struct policy_coding { const char *token; uint8_t bit; } "
              "policy_codings[] = {",
              *(f'    {{ "{t.decode()}", {bit} }},' for t, bit in negotiate.CODING_TOKENS.items()),
              "};"]
    return lines


def _record(rec: layout.Record) -> list[str]:
    struct_name = f"struct image_{rec.name}"
    members, checks, spans = [], [], []
    offset = 0
    for name, kind in rec.fields:
        suffixes = layout.KINDS[kind][1]
        if kind == "choice":
            members.append(f"    uint8_t {name}[{layout.MASKS}];")
            checks.append((name, offset))
            offset += layout.MASKS
            continue
        members.append("    uint32_t %s;" % ", ".join(name + s for s in suffixes))
        for s in suffixes:
            checks.append((name + s, offset))
            offset += 4
        if kind == "span":
            spans.append(f"X({name})")
    assert offset == rec.size, rec.name
    upper = rec.name.upper()
    lines = [f"{struct_name} {{", *members, "};", f"#define IMAGE_{upper}_SIZE {rec.size}",
             f'_Static_assert(sizeof({struct_name}) == IMAGE_{upper}_SIZE, "{rec.name} record");']
    lines += [f'_Static_assert(offsetof({struct_name}, {n}) == {off}, "{rec.name}.{n}");'
              for n, off in checks]
    if spans:
        lines.append(f"#define IMAGE_{upper}_SPANS(X) {' '.join(spans)}")
    return lines


def _image() -> list[str]:
    lines = ["/* The site image (layout.py): constants, and every record as a struct. A",
             " * span is bytes elsewhere in the image (_off, _len), a table records",
             " * (_off, _n); IMAGE_<RECORD>_SPANS lists a record's spans. */",
             f"#define IMAGE_MAGIC {layout.MAGIC:#x}u", f"#define IMAGE_VERSION {layout.VERSION}u",
             f"#define IMAGE_NONE {layout.NONE:#x}u", f"#define IMAGE_NO_VARIANT {layout.NO_VARIANT:#x}",
             f"#define IMAGE_ROUTE_ENTRY {layout.ROUTE_ENTRY}",
             f"#define IMAGE_ROUTE_REDIRECT {layout.ROUTE_REDIRECT}",
             f"#define IMAGE_ROUTE_NONE {layout.ROUTE_NONE}",
             f"#define IMAGE_ROUTE_QUERY {layout.ROUTE_QUERY}",
             f"#define IMAGE_ENTRY_CONDITIONAL {layout.ENTRY_CONDITIONAL}",
             f"#define IMAGE_MASKS {layout.MASKS}",
             *(f"#define IMAGE_{name} {getattr(layout, name)}" for name in
               ("PIECE_TEXT", "PIECE_SEGMENT", "PIECE_SPLAT", "PIECE_QUOTED", "PIECE_RAW",
                "PIECES_MAX", "SLOTS_MAX", "URL_MAX"))]
    for rec in layout.RECORDS:
        lines += ["", *_record(rec)]
    return lines


def render() -> str:
    sections = [_methods_and_statuses(), _limits(), _grammar(), _ranges_and_rules(), _tls_plain(),
                _codings(), _image()]
    body = "\n\n".join("\n".join(s) for s in sections)
    return (f"/* {NAME}: generated by orisha/targets/unikernel/policy_header.py from the Python\n"
            " * core's tables. DO NOT EDIT: change the Python and rebuild. */\n"
            "#ifndef ORISHA_POLICY_H\n#define ORISHA_POLICY_H\n"
            "#include <stddef.h>\n#include <stdint.h>\n\n"
            f"{body}\n\n#endif\n")


def write(outdir: str) -> str:
    """Write OUTDIR/policy.h (only when it changed, so make rebuilds only what it must)."""
    return write_header(outdir, NAME, render())


def write_header(outdir: str, name: str, text: str) -> str:
    """Write a generated header OUTDIR/NAME when its text changed; never half-written."""
    path = os.path.join(outdir, name)
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except FileNotFoundError:
        pass
    try:
        os.makedirs(outdir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # never a half-written header
    except OSError as e:
        raise BuildError(f"{path}: cannot write the generated header ({e.strerror})") from None
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m orisha.targets.unikernel.policy_header OUTDIR", file=sys.stderr)
        return 2
    try:
        print(write(argv[0]))
    except BuildError as e:
        print(f"policy_header: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
