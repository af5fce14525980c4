"""Retry tokens (orisha/protocols/quic_retry.py): what the worker accepts back is exactly
what it made for that address, that connection ID and within the lifetime."""

import pytest
from hypothesis import given, strategies as st

from orisha.protocols.quic_retry import LIFETIME, RetryTokens

ADDR = ("192.0.2.7", 4433)
ODCID, RSCID = bytes(range(8)), b"\xaa" * 8


def test_a_returned_token_gives_the_original_id():
    t = RetryTokens()
    token = t.create(ADDR, ODCID, RSCID, now=100.0)
    assert t.validate(ADDR, RSCID, token, now=101.0) == ODCID


@pytest.mark.parametrize("addr,dcid,now", [
    (("192.0.2.8", 4433), RSCID, 101.0),      # another address
    (("192.0.2.7", 4434), RSCID, 101.0),      # another port (a NAT's other mapping)
    (ADDR, b"\xab" * 8, 101.0),               # not sent to the Retry's source ID
    (ADDR, RSCID, 100.0 + LIFETIME + 0.01),   # expired
    (ADDR, RSCID, 99.0),                      # made "later" than now: another clock
])
def test_a_token_for_anything_else_is_refused(addr, dcid, now):
    t = RetryTokens()
    token = t.create(ADDR, ODCID, RSCID, now=100.0)
    with pytest.raises(ValueError):
        t.validate(addr, dcid, token, now)


def test_another_workers_token_is_refused():
    token = RetryTokens().create(ADDR, ODCID, RSCID, now=100.0)
    with pytest.raises(ValueError):
        RetryTokens().validate(ADDR, RSCID, token, now=100.0)


def test_ipv6_addresses():
    t, addr = RetryTokens(), ("2001:db8::1", 443)
    token = t.create(addr, ODCID, RSCID, now=5.0)
    assert t.validate(addr, RSCID, token, now=5.0) == ODCID


@given(st.binary(max_size=80))
def test_garbage_is_a_value_error_never_a_crash(token):
    with pytest.raises(ValueError):
        RetryTokens(key=b"k" * 32).validate(ADDR, RSCID, token, now=0.0)


@given(st.integers(0, 255), st.integers(0, 7))
def test_any_flipped_bit_is_refused(i, bit):
    t = RetryTokens()
    token = bytearray(t.create(ADDR, ODCID, RSCID, now=100.0))
    token[i % len(token)] ^= 1 << bit
    with pytest.raises(ValueError):
        t.validate(ADDR, RSCID, bytes(token), now=100.0)
