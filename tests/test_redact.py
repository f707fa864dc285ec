"""Secret-looking values in free text (``proxyvisor.redact``): the shapes a coding session leaks (cloud, chat and
package tokens, URL and header credentials, passwords in words, private keys) are found and replaced with the text
around them kept; ordinary session text (hashes, UUIDs, paths, base64 fixtures, variable references) is left
alone; the time grows with the text's length only, whatever the text."""

from __future__ import annotations

import time
import uuid

import pytest

from proxyvisor.adapters.failures import summary
from proxyvisor.redact import CUT_MARGIN, REDACTED, holds_secret, past_cut, redact, redact_cut

# (text, the secret in it); the fixtures are made-up values of each shape.
LEAKS = [
    ("Always export AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY before deploying.",
     "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    ("Always connect with postgres://admin:S3cr3tPassw0rd@db.internal:5432/app", "S3cr3tPassw0rd"),
    ("Always send Authorization: Basic YWRtaW46czNjcjN0cGFzc3dvcmQ= to staging", "YWRtaW46czNjcjN0cGFzc3dvcmQ="),
    ("curl -H 'Authorization: token 0123456789abcdef0123' https://api.example.com", "0123456789abcdef0123"),
    ("the maps key is AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW", "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW"),
    ("Always publish with npm_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8", "npm_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"),
    ("Always log in with password hunter2hunter2", "hunter2hunter2"),
    ("the password is S3cret!!", "S3cret!!"),
    ("use AKIAIOSFODNN7EXAMPLE for the bucket", "AKIAIOSFODNN7EXAMPLE"),
    ("key sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCD", "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCD"),
    ("key sk-ant-api03-abcdefghijklmnop0123", "sk-ant-api03-abcdefghijklmnop0123"),
    ("GITHUB_TOKEN=ghp_abcdefghijklmnopqrstuvwxyz0123456789", "ghp_abcdefghijklmnopqrstuvwxyz0123456789"),
    ("token github_pat_11ABCDEFG0123456789_abcdefghijklmnop", "github_pat_11ABCDEFG0123456789_abcdefghijklmnop"),
    ("post with xoxb-123456789012-1234567890123-abcdefghijkl", "xoxb-123456789012-1234567890123-abcdefghijkl"),
    ("charge with sk_live_4eC39HqLyjWDarjtT1zdp7dc", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    ("restricted rk_live_abcdefghij1234567890", "rk_live_abcdefghij1234567890"),
    ("jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFU",
     "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFU"),
    ("Bearer abcdef123456789", "abcdef123456789"),
    ("password: hunter2222", "hunter2222"),
    ("api_key=abcdef123456", "abcdef123456"),
    ('{"client_secret": "9f8e7d6c5b4a"}', "9f8e7d6c5b4a"),
    ("export OPENAI_API_KEY='not-an-sk-shape-but-assigned'", "not-an-sk-shape-but-assigned"),
    ("DB_PASSWD=correcthorse", "correcthorse"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA0Z3VS5JJcds3xfn\n-----END RSA PRIVATE KEY-----\nafter",
     "MIIEowIBAAKCAQEA0Z3VS5JJcds3xfn"),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ (cut)", "b3BlbnNzaC1rZXktdjE"),
]

ORDINARY = [
    "Always run pytest -q before committing; the fix is in commit 3f9a2c1d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a39",
    f"Never touch migrations/; the task id is {uuid.UUID(int=0x1234_5678_9ABC_DEF0_1234_5678_9ABC_DEF0)}",
    "Always use uv, never pip. The entry point is src/app/main.py and config lives at /etc/app/config.toml",
    "data = base64.b64decode('SGVsbG8gd29ybGQsIHRoaXMgaXMgYSB0ZXN0IGZpeHR1cmUgZm9yIGRlY29kaW5n')",
    "sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "integrity sha512-Hq0pSJzO8xD1FqD4Wz3UdjM7SyXPrEj+Tr1k2T3P8Zp2l3Gq1QY8uC0k7M1z3pZr2xV3n4E8bLqJ3fXc5sK1w==",
    "The password field must be validated in forms.py; token expiry is 3600 seconds",
    "export GITHUB_TOKEN=$GH_TOKEN and API_TOKEN=${API_TOKEN} and PASSWORD_FILE=<path>",
    "API_KEY = os.environ.get('API_KEY')",
    "client = AsyncAnthropic(api_key=settings.anthropic_api_key); NEO4J_PASSWORD=redacted uv run pytest",
    "max_tokens=100000, token_count: 123456, tokenizer: callable",
    "Use bearer tokens for the API; the Authorization header is built in client.py",
    "password reset lives in auth/views.py; def check_password(pw: str) -> bool:",
    "git clone https://github.com/org/repo.git and ssh git@github.com:org/repo.git",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAAB",
    "scikit-learn (sk-learn) is installed",
]


@pytest.mark.parametrize(("text", "secret"), LEAKS)
def test_a_secret_is_found_and_replaced_with_its_context_kept(text: str, secret: str) -> None:
    assert holds_secret(text)
    redacted = redact(text)
    assert secret not in redacted and REDACTED in redacted
    head = text.split(secret)[0][:6]
    assert redacted.startswith(head), "what comes before the secret is kept"


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_session_text_holds_no_secret(text: str) -> None:
    assert not holds_secret(text)
    assert redact(text) == text


def test_known_credentials_are_found_whatever_their_shape() -> None:
    assert holds_secret("pass xyz-token-42 to the cli", ["xyz-token-42"])
    assert redact("pass xyz-token-42 to the cli", ["", "xyz-token-42"]) == f"pass {REDACTED} to the cli"
    assert not holds_secret("pass it to the cli", ["xyz-token-42", ""])


def test_failure_summaries_redact_every_shape() -> None:
    message = "deploy failed: AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY rejected " + "x" * 400
    assert "wJalrX" not in summary(message) and REDACTED in summary(message) and len(summary(message)) == 300


@pytest.mark.parametrize("text", [
    "token=a." * 125_000 + "(",               # an assignment's value that fails at its very end, many times over
    "api_key_" * 125_000,                     # keywords without an assignment
    "https://a:b" * 90_000,                   # userinfo without an @
    "bearer " + "a" * 1_000_000,              # a long word with no digit after bearer
    "password " * 110_000,                    # password phrases without a secret
    "-----BEGIN RSA PRIVATE KEY-----" * 30_000,
    "QUJD" * 250_000,                         # one long base64 word
])
def test_the_time_grows_with_the_length_only(text: str) -> None:
    started = time.process_time()
    holds_secret(text)
    redact(text)
    assert time.process_time() - started < 3, "about 0.3 s per MB; a quadratic pattern takes minutes"


def test_a_secret_the_cut_runs_through_is_redacted_whole_and_the_cut_marked() -> None:
    key = "sk-proj-" + "a1B2c3D4" * 6
    text = "x" * 290 + " " + key + " and more words after it"
    cut = redact_cut(text, 300, mark="…")
    assert cut == "x" * 290 + " " + REDACTED[:8] + "…" and key[:8] not in cut
    assert redact_cut("short " + key, 300) == "short " + REDACTED
    assert redact_cut("short hunter", 300, known=["hunter"]) == "short " + REDACTED
    assert past_cut(text, 10) == text[:10 + CUT_MARGIN]
