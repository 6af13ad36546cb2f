"""`gradmon top` against endpoints that attack it: real servers on 127.0.0.1 (see
hostile_servers.py) that stream without end, drip, redirect elsewhere, or write escape
sequences where names go; and the sanitizer over every code point there is."""

from __future__ import annotations

import codecs
import contextlib
import io
import re
import ssl
import time
import tracemalloc
import unicodedata

import pytest

from gradmon.clients import top
from gradmon.clients.sanitize import clean
from hostile_servers import RawServer, drip, endless, exposition, forward_proxy, header, redirect, respond

# what a terminal obeys (Cc: C0, DEL, C1), hides or reorders (Cf: bidi, zero-width), breaks
# lines at (Zl, Zp), or has no glyph for (Cs, Co, Cn), and spaces that are not U+0020
UNSAFE_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"}
# Unicode's Default_Ignorable_Code_Point outside those categories: drawn as nothing
INVISIBLE_LETTERS_AND_MARKS = {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0, *range(0x180B, 0x180E + 1),
                               0x180F, *range(0xFE00, 0xFE0F + 1), *range(0xE0100, 0xE01EF + 1)}
ESCAPE = re.compile(r"\\x[0-9a-f]{2}|\\u[0-9a-f]{4}|\\U[0-9a-f]{8}")


def run_top(*argv: str):
    """``gradmon top ARGV --once``: (exit status, what it printed, what it said on stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stderr(err):
        status = top.main([*argv, "--once", "--interval", "0.1"], out=out)
    return status, out.getvalue(), err.getvalue(), time.monotonic() - began


def tls_server(pki) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.dir / "server.pem", pki.dir / "server.key")
    return context


def assert_terminal_safe(text: str) -> None:
    bad = sorted({f"U+{ord(ch):04X}" for ch in text if ch != "\n" and unicodedata.category(ch) in UNSAFE_CATEGORIES
                  and ch != " "})
    assert not bad, f"code points a terminal obeys or hides reached the output: {bad}"


# -- one sanitizer, every code point ------------------------------------------------------------

def test_clean_escapes_every_control_format_separator_and_unassigned_code_point_and_keeps_the_rest():
    for cp in range(0x110000):
        ch = chr(cp)
        shown = clean(ch)
        unsafe = (unicodedata.category(ch) in UNSAFE_CATEGORIES and ch != " ") or cp in INVISIBLE_LETTERS_AND_MARKS
        if unsafe:
            assert ESCAPE.fullmatch(shown), f"U+{cp:04X} ({unicodedata.category(ch)}) shown as {shown!r}"
            assert codecs.decode(shown, "unicode_escape") == ch  # the escape names the code point
        else:
            assert shown == ch, f"printable U+{cp:04X} ({unicodedata.category(ch)}) changed to {shown!r}"


def test_clean_of_all_code_points_in_one_string_is_terminal_safe_and_idempotent():
    text = "".join(map(chr, range(0x110000)))
    shown = clean(text)
    assert_terminal_safe(shown.replace("\n", "\\n"))
    assert clean(shown) == shown


def test_clean_shows_the_attacks_of_the_issue_as_visible_escapes():
    assert clean("\x1b]0;pwned\x07\x1b[2J") == "\\x1b]0;pwned\\x07\\x1b[2J"
    assert clean("a\x9b31mb\u202ec\u200bd\n  ok") == "a\\x9b31mb\\u202ec\\u200bd\\x0a  ok"
    assert clean("blocks.0.fc1 ▁▂█ 名前") == "blocks.0.fc1 ▁▂█ 名前"


# -- what the endpoint writes never reaches the terminal raw ------------------------------------

SPOOF = "\n  ok: all 12 local checks pass"


def test_escape_sequences_and_a_newline_in_label_values_are_shown_escaped():
    # NaNs counted: the only "ok" row this frame could show is a spoofed one
    body = exposition(model="m\x1b]0;pwned\x07\x1b[2J\x9b1m\u202e" + SPOOF, layer="fc\x1b[31m\u200b1", nonfinite=7)
    with RawServer(respond(body=body)) as server:
        status, out, _, _ = run_top(server.url)
    assert status == 0
    assert_terminal_safe(out.replace("\n", ""))
    assert "model m\\x1b]0;pwned\\x07\\x1b[2J\\x9b1m\\u202e\\x0a  ok: all 12 local checks pass  rank 0" in out
    assert "fc\\x1b[31m\\u200b1" in out
    assert not [line for line in out.splitlines() if line.lstrip().startswith("ok:")]  # no spoofed row


def test_escape_sequences_in_the_reason_phrase_are_shown_escaped():
    with RawServer(respond(b"503 \x1b]0;owned\x07\x1b[2J\x9b2Jdown", (b"Content-Length: 0",))) as server:
        status, out, _, _ = run_top(server.url)
    assert status == 1
    assert_terminal_safe(out.replace("\n", ""))
    assert "HTTP 503 \\x1b]0;owned\\x07\\x1b[2J\\x9b2Jdown" in out


# -- bounded in size and in time ----------------------------------------------------------------

def test_an_endless_body_is_refused_at_the_default_32_mb_with_memory_bounded():
    with RawServer(endless()) as server:
        tracemalloc.start()
        try:
            status, out, _, seconds = run_top(server.url)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        sent = server.sent
    assert status == 1
    assert "larger than 33,554,432 bytes" in out
    assert peak < 80 * 2 ** 20, f"peak {peak / 2 ** 20:.0f} MB"
    assert sent < 64 * 2 ** 20  # it stopped reading: what the server got rid of is the bound plus buffers


def test_max_bytes_sets_the_bound():
    with RawServer(endless()) as server:
        status, out, _, _ = run_top(server.url, "--max-bytes", "1M")
    assert status == 1 and "larger than 1,048,576 bytes (--max-bytes)" in out


def test_a_declared_length_above_the_bound_is_refused_before_reading_the_body():
    huge = respond(headers=(b"Content-Type: text/plain", b"Content-Length: 10000000000"))
    with RawServer(huge) as server:
        status, out, _, seconds = run_top(server.url)
    assert status == 1 and "larger than 33,554,432 bytes" in out


def test_one_deadline_covers_a_response_that_drips_one_byte_at_a_time():
    with RawServer(drip(every=0.1)) as server:
        status, out, _, seconds = run_top(server.url, "--timeout", "1")
    assert status == 1
    assert "no complete response within 1 s (connect, headers and body)" in out
    assert seconds < 3, f"--once took {seconds:.1f} s against a 1 s deadline"


# -- redirects are never followed, credentials never travel -------------------------------------

def test_a_redirect_to_another_host_is_printed_not_followed_and_exits_1():
    with RawServer(respond(body=exposition())) as elsewhere:
        target = f"http://localhost:{elsewhere.port}/metrics"
        with RawServer(redirect(target)) as server:
            status, out, err, _ = run_top(server.url.replace("://", "://prom:s3cret@"))
        assert status == 1
        assert f"a redirect to {target}" in err and "Not followed" in err
        assert elsewhere.requests == []  # the credentials never went there
        assert header(server.requests[0], "Authorization")  # they went where they were meant to
        assert "s3cret" not in out + err


def test_a_redirect_from_https_to_http_is_not_followed(pki):
    with RawServer(respond(body=exposition())) as cleartext:
        with RawServer(redirect(cleartext.url, status=301), tls=tls_server(pki)) as server:
            status, _, err, _ = run_top(server.url, "--user", "prom", "--cacert", str(pki.dir / "ca.pem"))
        assert status == 1
        assert f"HTTP 301, a redirect to {cleartext.url}" in err
        assert cleartext.requests == []


def test_the_password_in_a_redirects_location_is_masked():
    with RawServer(redirect("http://evil:hunter2@localhost:1/x\x1b[2J")) as server:
        status, _, err, _ = run_top(server.url)
    assert status == 1
    assert "http://evil:***@localhost:1/x\\x1b[2J" in err and "hunter2" not in err


def test_the_password_is_never_printed_even_when_the_server_echoes_it():
    with RawServer(respond(b"401 wrong password s3cret", (b"Content-Length: 0",))) as server:
        status, out, _, _ = run_top(server.url.replace("://", "://prom:s3cret@"))
    assert status == 1
    assert "prom:***@127.0.0.1" in out and "HTTP 401 wrong password ***" in out and "s3cret" not in out


# -- proxies: only the one asked for ------------------------------------------------------------

PROXY_VARIABLES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def test_proxies_from_the_environment_are_ignored(monkeypatch):
    with RawServer(forward_proxy()) as proxy, RawServer(respond(body=exposition())) as server:
        for name in PROXY_VARIABLES:
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        status, out, _, _ = run_top(server.url, "--user", "prom")
        assert status == 0 and "model m  rank 0" in out
        assert proxy.requests == []
        assert header(server.requests[0], "Authorization")


def test_an_explicit_proxy_is_used_with_its_own_credentials():
    with RawServer(forward_proxy()) as proxy, RawServer(respond(body=exposition())) as server:
        status, out, _, _ = run_top(server.url, "--proxy", f"http://me:pw@127.0.0.1:{proxy.port}")
        assert status == 0 and "model m  rank 0" in out
        assert proxy.requests[0].startswith(f"GET {server.url} HTTP/1.1".encode())
        assert header(proxy.requests[0], "Proxy-Authorization") == "Basic bWU6cHc="
        assert header(server.requests[0], "Proxy-Authorization") is None


def test_an_explicit_proxy_tunnels_https_without_seeing_the_request(pki):
    with RawServer(forward_proxy()) as proxy, RawServer(respond(body=exposition()), tls=tls_server(pki)) as server:
        status, out, _, _ = run_top(server.url, "--proxy", f"http://127.0.0.1:{proxy.port}", "--user", "prom",
                                    "--cacert", str(pki.dir / "ca.pem"))
        assert status == 0 and "model m  rank 0" in out
        assert proxy.requests[0].startswith(f"CONNECT 127.0.0.1:{server.port} HTTP/1.1".encode())
        assert header(proxy.requests[0], "Authorization") is None  # the credentials went inside TLS
        assert header(server.requests[0], "Authorization")


def test_a_name_that_does_not_resolve_is_an_error_within_the_deadline():
    status, out, _, seconds = run_top("http://gradmon-top-test.invalid:9400/", "--timeout", "2")
    assert status == 1 and "cannot read the endpoint: " in out
    assert seconds < 4


def test_help_states_the_rules_for_redirects_and_proxies(capsys):
    with pytest.raises(SystemExit):
        top.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a redirect is never followed" in text
    assert "proxies from the environment (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY) are ignored" in text
    assert "only a proxy named with --proxy ever sees the request and its credentials" in text


def test_a_line_too_long_to_parse_in_time_is_refused():
    labels = ",".join(f'l{i}="v"' for i in range(200000))
    with RawServer(respond(body=f'gradmon_x{{{labels},model="m"}} 1\n'.encode())) as server:
        status, out, _, seconds = run_top(server.url)
    assert status == 1 and "a line longer than 65,536 characters: not a gradmon exposition" in out
    assert seconds < 5
