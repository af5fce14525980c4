"""HTTP dates without the ``time`` module.

Strategy: the core must not import ``time`` (the loop passes the clock in),
and the unikernel has to produce the same bytes from an integer, so dates are
plain arithmetic on days since 1970-01-01 (H. Hinnant's civil-date algorithms).
Formatting emits IMF-fixdate; parsing accepts the three forms RFC 9110 §5.6.7
says a recipient MUST accept (IMF-fixdate, RFC 850, asctime).
"""

from __future__ import annotations

from .request import decimal

_DAYS = (b"Thu", b"Fri", b"Sat", b"Sun", b"Mon", b"Tue", b"Wed")  # 1970-01-01 was a Thursday
_MONTHS = (b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun",
           b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec")
_MONTH_NUMBER = {m: i + 1 for i, m in enumerate(_MONTHS)}


def _civil_from_days(z: int) -> tuple[int, int, int]:
    z += 719468
    era = (z if z >= 0 else z - 146096) // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    y = yoe + era * 400
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + 3 if mp < 10 else mp - 9
    return (y + 1 if m <= 2 else y), m, d


def _days_from_civil(y: int, m: int, d: int) -> int:
    y -= m <= 2
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def format_http_date(epoch: int) -> bytes:
    """IMF-fixdate for whole seconds since the epoch, e.g. b'Sun, 06 Nov 1994 08:49:37 GMT'."""
    days, secs = divmod(int(epoch), 86400)
    y, m, d = _civil_from_days(days)
    hh, rest = divmod(secs, 3600)
    mm, ss = divmod(rest, 60)
    return b"%s, %02d %s %04d %02d:%02d:%02d GMT" % (
        _DAYS[days % 7], d, _MONTHS[m - 1], y, hh, mm, ss)


def _clock(text: bytes) -> int | None:
    parts = text.split(b":")
    if len(parts) != 3 or not all(len(p) == 2 and p.isdigit() for p in parts):
        return None
    h, mi, s = (int(p) for p in parts)
    if h > 23 or mi > 59 or s > 60:
        return None
    return h * 3600 + mi * 60 + min(s, 59)


def _epoch(y: int, mon: bytes, d: int, clock: bytes) -> int | None:
    m = _MONTH_NUMBER.get(mon)
    secs = _clock(clock)
    if m is None or secs is None or not 1 <= d <= 31:
        return None
    return _days_from_civil(y, m, d) * 86400 + secs


# Day and year are 1*DIGIT (RFC 9110 §5.6.7: no sign, no "_"); a year beyond this
# is read as this, which compares with any real file time as the exact year would
# (the C core gets the bound from its generated header).
YEAR_MAX = 10**9


def _number(text: bytes) -> int:
    n = decimal(text, YEAR_MAX)
    if n is None:
        raise ValueError(text)
    return n


def parse_http_date(value: bytes) -> int | None:
    """Seconds since the epoch, or None when *value* is not an HTTP-date."""
    f = value.strip().split()
    try:
        if len(f) == 6 and f[0].endswith(b",") and f[5] == b"GMT":  # IMF-fixdate
            if len(f[1]) != 2 or len(f[3]) != 4:
                return None
            return _epoch(_number(f[3]), f[2], _number(f[1]), f[4])
        if len(f) == 4 and f[0].endswith(b",") and f[3] == b"GMT":  # RFC 850
            d, mon, yy = f[1].split(b"-")
            y = _number(yy)
            if len(yy) == 2:  # RFC 9110 §5.6.7: a two-digit year >50 years ahead is in the past
                y += 1900 if y >= 70 else 2000
            return _epoch(y, mon, _number(d), f[2])
        if len(f) == 5:  # asctime: Sun Nov  6 08:49:37 1994
            return _epoch(_number(f[4]), f[1], _number(f[2]), f[3])
    except ValueError:  # a non-numeric day or year: not a date
        return None
    return None
