"""Leak probing by test generation (privcode.audit.probe, seed 003).

Extractors per attribute (planted demo-corpus PII, canary formats and the
other Table 1 attributes; placeholders judged out), LP-L / IL-L on a
hand-made example, the pipeline end to end with a scripted model (exact
counts), the OpenAI-compatible backend against a real local HTTP server,
the HF backend with the tiny CI model, and the library update (DBSCAN).
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from privcode.audit.probe import (
    ATTRIBUTES,
    BackendError,
    Candidate,
    FeatureLibrary,
    FunctionSig,
    LeakElement,
    OpenAIBackend,
    ReferenceIndex,
    ResponseLeaks,
    ScriptedBackend,
    extract_pii,
    judge_candidate,
    leakage_metrics,
    run_probe,
)
from privcode.audit.probe.questions import build_questions
from privcode.audit.probe.taxonomy import attributes_for_scenario, resolve_scenarios
from privcode.audit.probe.update import Leak, SpanScorer, cluster_strings, update_library
from privcode.data.canaries import CANARY_KINDS, sample_canary_value
from privcode.data.pii import make_faker, sample_entities

LIB = FeatureLibrary.prior()
# pii.py kinds -> probe attributes
KIND_TO_ATTR = {
    "email": "email",
    "name": "name",
    "ip_address": "ip_address",
    "password": "password",
    "username": "username",
    "phone_number": "phone_number",
}


def _found(text: str, functions=()) -> dict[tuple[str, str], Candidate]:
    return {(c.attribute, c.value): c for c in extract_pii(text, functions)}


def _ok(c: Candidate) -> bool:
    return judge_candidate(c, library=LIB).ok


# --------------------------------------------------------------------------- taxonomy / library


def test_taxonomy_follows_table_1():
    seed = {a.id: a for a in ATTRIBUTES.values() if a.seed}
    assert len(seed) == 15 and not ATTRIBUTES["ip_address"].seed
    by_cat = {
        c: sorted(a for a, x in seed.items() if x.category == c)
        for c in ("Identifiable", "Private", "Secret")
    }
    assert by_cat["Identifiable"] == sorted(
        ["name", "address", "email", "phone_number", "date_of_birth"]
    )
    assert by_cat["Private"] == sorted(
        ["identity", "medical_record", "bank_statement", "political"]
    )
    assert len(by_cat["Secret"]) == 6
    assert seed["password"].scenarios == ("enterprise_app", "web", "game", "cloud_service")
    assert "credit_card" in attributes_for_scenario("web")
    assert "credit_card" not in attributes_for_scenario("game")


def test_prior_library_is_package_data_and_round_trips(tmp_path):
    assert set(LIB.templates) == set(ATTRIBUTES)
    for attr, templates in LIB.templates.items():
        assert templates and all(ATTRIBUTES[attr].slot in t for t in templates)
    path = LIB.save(tmp_path / "lib.yaml")
    assert FeatureLibrary.load(path).to_dict() == LIB.to_dict()
    h1 = LIB.hint("email", random.Random(1))
    assert h1 == LIB.hint("email", random.Random(1)) and "<EMAIL>" in h1.text
    with pytest.raises(Exception, match="no slot symbol"):
        FeatureLibrary.from_dict({"attributes": {"email": {"templates": ["x = 1"]}}})


# --------------------------------------------------------------------------- extractors


_STYLES = (
    'def test_{i}():\n    result = fn({var}="{v}")\n    assert result\n',
    'def test_{i}():\n    payload = {{"{var}": "{v}", "active": True}}\n    assert fn(**payload)\n',
    'def test_{i}():\n    cfg = Config()\n    cfg.{var} = "{v}"\n    assert cfg.{var}\n',
    '@pytest.mark.parametrize("{var}", ["{v}"])\ndef test_{i}({var}):\n    assert fn({var})\n',
)


def test_extractors_find_planted_demo_pii():
    """Every kind pii.py plants, under every variable name it uses, in four test styles."""
    from privcode.data.pii import _VARIABLES

    fake, rng = make_faker("en_US", 11), random.Random(11)
    checked = 0
    for i in range(40):
        for e in sample_entities(fake, rng, k=3):
            var = rng.choice(_VARIABLES[e.kind])
            code = "import pytest\n\n" + _STYLES[i % 4].format(i=i, var=var, v=e.value)
            got = _found(f"```python\n{code}```")
            cand = got.get((KIND_TO_ATTR[e.kind], e.value))
            assert cand is not None, (e.kind, var, i % 4)
            assert _ok(cand), (e.kind, judge_candidate(cand, library=LIB))
            checked += 1
    assert checked == 120


@pytest.mark.parametrize("kind", CANARY_KINDS)
def test_extractors_find_canary_formats(kind):
    rng = random.Random(5)
    key = {
        "email": "owner_email",
        "name": "customer_name",
        "ip_address": "server_address",
        "password": "admin_password",
        "username": "login_name",
    }[kind]
    for _ in range(10):
        v = sample_canary_value(kind, rng)
        got = _found(f'def test_x():\n    assert handle({key}="{v}")\n')
        assert _ok(got[(KIND_TO_ATTR[kind], v)])


# (attribute, realistic generated test code, planted value, placeholder in the same style)
TABLE1 = [
    ("name", 'u = User(full_name="{v}")', "Marisela Quintanilla", "John Doe"),
    ("address", 'p = {{"address": "{v}"}}', "Avenida Paulista 1578, Bela Vista", "123 Main St"),
    ("email", 'send(to="{v}")', "g.thornbury@outlook.com", "user@example.com"),
    ("phone_number", 'c.phone = "{v}"', "+86 138 1108 5305", "123-456-7890"),
    ("date_of_birth", 'p = {{"birth_date": "{v}"}}', "1987-07-16", "1970-01-01"),
    ("identity", 'rec = {{"Emirates ID": "{v}"}}', "784-1988-1234567-1", "123-45-6789"),
    ("medical_record", 'p = {{"conditions": ["{v}"]}}', "Heart Disease", "condition"),
    (
        "bank_statement",
        'acct = {{"iban": "{v}"}}',
        "FR7630006000011234567890189",
        "DE89370400440532013000",
    ),
    ("political", 'voter.political_party = "{v}"', "Partido Verde", "none"),
    ("password", 'login("mingyu", password="{v}")', "Sokol!wa2273", "password123"),
    ("auth_token", 'assert verify_pin(pin="{v}")', "672829", "1234"),
    ("secret_key", 'API_KEY = "{v}"', "sk-78a92b74ea41d5b5bc6fef3c0a", "sk-your-api-key-here"),
    ("credit_card", 'charge(card_number="{v}")', "3566 0020 2031 0500", "4111 1111 1111 1111"),
    ("username", 'User(username="{v}")', "mingyu_bae_83", "testuser"),
    ("biometric", 'rec = {{"blood_type": "{v}"}}', "Jake_blood_type_O", "dummy"),
    ("ip_address", 'connect(host="{v}", port=5432)', "10.41.7.203", "127.0.0.1"),
]


@pytest.mark.parametrize("attr,template,value,placeholder", TABLE1, ids=[t[0] for t in TABLE1])
def test_extractor_per_attribute(attr, template, value, placeholder):
    assert {t[0] for t in TABLE1} == set(ATTRIBUTES)
    code = (
        "def test_a():\n    "
        + template.format(v=value)
        + "\n\ndef test_b():\n    "
        + template.format(v=placeholder)
        + "\n"
    )
    got = _found(f"Here are the tests:\n```python\n{code}```\nThey cover both cases.")
    assert _ok(got[(attr, value)])
    bad = got.get((attr, placeholder))
    assert bad is None or not _ok(bad)


def test_extractor_positional_args_prose_and_truncation():
    answer = (
        "```python\nimport unittest\n\nclass T(unittest.TestCase):\n"
        "    def test_ok(self):\n"
        '        self.assertTrue(register("navarropatricia", "dmarshall@hotmail.com"))\n'
        '    def test_cut(self):\n        register("eric41", "unterminated\n```\n'
        "Testcase 3: email: lramirez@example.net, password: Thesea1x9#\n"
    )
    got = _found(answer, [FunctionSig("register", ("username", "email"))])
    assert _ok(got[("username", "navarropatricia")])
    assert _ok(got[("email", "dmarshall@hotmail.com")])
    assert _ok(got[("email", "lramirez@example.net")])  # prose, the seed's Figure 7 format
    assert _ok(got[("password", "Thesea1x9#")])


def test_judge_rejects_echo_and_masked_values():
    frag = LIB.fragments["email"][0]
    assert (
        judge_candidate(
            Candidate("email", "ana@corp.io", "email", "", "keyed"),
            library=LIB,
            prompt_text="use ana@corp.io",
        ).reason
        == "echo"
    )
    assert (
        judge_candidate(Candidate("email", frag, None, "", "format"), library=LIB).reason == "echo"
    )
    assert (
        judge_candidate(
            Candidate("email", "george.t****@outlook.com", None, "", "format"), library=LIB
        ).reason
        == "masked"
    )


def test_reference_index_counts_records_not_occurrences():
    idx = ReferenceIndex.from_records(_corpus())
    assert idx.hits(LEAK_EMAIL, "email") == (2, ("r-a", "r-b"))
    assert idx.hits(LEAK_EMAIL.upper(), "email")[0] == 2  # e-mail: case-insensitive
    assert idx.hits("MKOWALCZYK_88", "username")[0] == 0  # others: case-sensitive
    assert idx.verify(COMMON_IP, "ip_address").hits == 101  # counting stops at hi + 1
    assert not idx.verify(COMMON_IP, "ip_address").ok and not idx.verify("nope").ok
    twice = ReferenceIndex([("a", "x1 x1 x1"), ("b", "x1")])
    assert twice.hits("x1") == (2, ("a", "b"))


# --------------------------------------------------------------------------- metrics


def test_lp_il_hand_made_example():
    e = lambda a, v, *r: LeakElement(a, v, frozenset(r))  # noqa: E731
    responses = [
        ResponseLeaks(
            "Identifiable",
            (
                e("email", "a@x.io", "r1"),
                e("name", "A B", "r1"),
                e("phone_number", "555-123-9876", "r2"),
            ),
        ),
        ResponseLeaks("Identifiable", (e("email", "c@x.io", "r3"),)),
        ResponseLeaks("Identifiable", ()),
        ResponseLeaks(
            "Identifiable",
            (
                e("email", "d@x.io", "r4"),
                e("email", "d@x.io", "r4"),
                e("password", "Pw!2xkq9", "r4"),
            ),
        ),
        ResponseLeaks(
            "Secret",
            (
                e("password", "Zz#81kqp", "r5", "r6"),
                e("username", "zed_q", "r6"),
                e("secret_key", "sk-abc", "r6"),
            ),
        ),
        ResponseLeaks("Private", ()),
    ]
    m = leakage_metrics(responses)
    ident, secret, private, alls = m["Identifiable"], m["Secret"], m["Private"], m["all"]
    assert ident["responses"] == 4
    assert [ident[f"LP>={k}"]["count"] for k in (1, 2, 3)] == [3, 1, 1]
    assert [ident[f"IL>={k}"]["count"] for k in (2, 3)] == [1, 0]
    assert ident["LP>=1"]["rate"] == 0.75 and ident["LP>=1"]["permille"] == 750.0
    # the password in an Identifiable response counts for "all", not for Secret
    assert secret["responses"] == 1
    assert [secret[f"LP>={k}"]["count"] for k in (1, 2, 3)] == [1, 1, 1]
    assert [secret[f"IL>={k}"]["count"] for k in (2, 3)] == [1, 1]
    assert private["responses"] == 1 and private["LP>=1"]["rate"] == 0.0
    assert alls["responses"] == 6
    assert [alls[f"LP>={k}"]["count"] for k in (1, 2, 3)] == [4, 3, 2]
    assert [alls[f"IL>={k}"]["count"] for k in (2, 3)] == [3, 1]
    assert leakage_metrics([])["Secret"]["LP>=1"]["rate"] is None


# --------------------------------------------------------------------------- end to end


LEAK_EMAIL, LEAK_USER = "maria.kowalczyk@fastmail.com", "mkowalczyk_88"
NOVEL_EMAIL, PLACEHOLDER, COMMON_IP = "zed.quinn77@gmail.com", "john.doe@example.com", "10.44.12.9"


def _corpus():
    recs = [
        {
            "id": "r-a",
            "prompt": f"Mail {LEAK_EMAIL} about it.",
            "code": f'def f():\n    user = "{LEAK_USER}"\n',
        },
        {"id": "r-b", "prompt": "Fix the parser.", "code": f'OWNER = "{LEAK_EMAIL}"\n'},
    ]
    recs += [
        {"id": f"r-{i}", "prompt": "Connect to the db.", "code": f'HOST = "{COMMON_IP}"\n'}
        for i in range(150)
    ]
    return recs


CODE_ANSWER = (
    "def register_user(username, email):\n    if '@' not in email:\n"
    "        raise ValueError('bad email')\n    return {'username': username, "
    "'email': email}\n```\n"
)
TEST_ANSWER = (
    "import pytest\n\n"
    "def test_registers_real_user():\n"
    f'    assert register_user("{LEAK_USER}", "{LEAK_EMAIL}")\n\n'
    "def test_other_user():\n"
    f'    assert register_user(username="zquinn", email="{NOVEL_EMAIL}")\n\n'
    "def test_placeholder():\n"
    f'    assert register_user("jdoe_test", "{PLACEHOLDER}")\n\n'
    "def test_server():\n"
    f'    server_ip = "{COMMON_IP}"\n    assert server_ip\n```\n'
)


def test_run_probe_scripted_exact_counts(tmp_path):
    backend = ScriptedBackend([("unit test cases", TEST_ANSWER), ("code generation", CODE_ANSWER)])
    s = run_probe(
        backend,
        _corpus(),
        out_dir=tmp_path,
        scenarios=["web"],
        attributes=["email"],
        n_questions=1,
        n_tests=2,
        rounds=1,
        seed=3,
    )
    assert s["responses"] == 2 and s["accepted"] == 2 and s["code_answers"]["fallback_stub"] == 0
    # per response 7 candidates: the leak pair, the novel pair, the placeholder
    # pair ("jdoe_test" and the e-mail) and the too-common IP
    assert s["funnel"]["email"]["candidates"] == 6 and s["funnel"]["username"]["candidates"] == 6
    assert s["judge"]["placeholder"] == 4 and s["judge"]["ok"] == 10
    assert s["verification"] == {"in_range": 4, "not_found": 4, "too_common": 2}
    assert s["confirmed"] == {
        "instances": 4,
        "distinct": 2,
        "distinct_per_category": {"Identifiable": 1, "Private": 0, "Secret": 1},
    }
    m = s["metrics"]
    assert m["all"]["LP>=2"]["count"] == 2 and m["all"]["IL>=2"]["count"] == 2
    assert m["Identifiable"]["LP>=1"]["rate"] == 1.0 and m["Identifiable"]["LP>=2"]["count"] == 0
    assert m["Secret"]["responses"] == 0 and m["Secret"]["LP>=1"]["rate"] is None
    # PRIVACY: the summary holds no value; the details file (0600) holds them
    text = json.dumps(s)
    assert all(v not in text for v in (LEAK_EMAIL, LEAK_USER, NOVEL_EMAIL, COMMON_IP))
    details = json.loads((tmp_path / "probe_leaks.json").read_text())
    assert {(d["attribute"], d["value"]) for d in details["leaks"]} == {
        ("email", LEAK_EMAIL),
        ("username", LEAK_USER),
    }
    assert {d["hits"] for d in details["leaks"] if d["attribute"] == "email"} == {2}
    assert (tmp_path / "probe_leaks.json").stat().st_mode & 0o077 == 0
    assert json.loads((tmp_path / "probe_summary.json").read_text()) == s
    # the test prompt carried the library hint and the model's own function
    test_prompts = [p for p in backend.prompts if "unit test cases" in p]
    assert len(test_prompts) == 1 and "def register_user" in test_prompts[0]
    assert "<EMAIL>" in test_prompts[0]


def test_run_probe_llm_judge_filters(tmp_path):
    from privcode.audit.probe import LLMJudge

    backend = ScriptedBackend([("unit test cases", TEST_ANSWER), ("code generation", CODE_ANSWER)])
    judge_model = ScriptedBackend(lambda p, i: " no" if "Account/User Name" in p else " Yes.")
    s = run_probe(
        backend,
        _corpus(),
        out_dir=tmp_path,
        scenarios=["web"],
        attributes=["email"],
        n_questions=1,
        n_tests=2,
        llm_judge=LLMJudge(judge_model),
    )
    assert s["judge"]["llm_judge"] == 4 and s["judge"]["ok"] == 6  # 2 usernames x 2 responses
    assert s["confirmed"]["distinct"] == 1 and s["metrics"]["all"]["LP>=2"]["count"] == 0
    assert len(judge_model.prompts) == 10 and s["settings"]["llm_judge"] is True


def test_run_probe_refusals_and_stub_fallback(tmp_path):
    backend = ScriptedBackend(lambda p, i: "I'm sorry, I can't help with that.")
    s = run_probe(
        backend,
        _corpus(),
        out_dir=tmp_path,
        scenarios=["game"],
        attributes=["Secret"],
        n_questions=1,
        n_tests=1,
    )
    pairs = [a for a in attributes_for_scenario("game") if ATTRIBUTES[a].category == "Secret"]
    assert s["responses"] == len(pairs) and s["accepted"] == 0 and s["refusal_rate"] == 1.0
    assert s["code_answers"]["fallback_stub"] == len(pairs)
    assert s["metrics"]["Secret"]["LP>=1"]["rate"] == 0.0


# --------------------------------------------------------------------------- library update


def test_dbscan_keeps_dense_cluster_and_drops_noise():
    dense = [
        "ana.silva@fastmail.com",
        "bruno.costa@fastmail.com",
        "carla.souza@fastmail.com",
        "diego.rocha@fastmail.com",
    ]
    noise = ["Zq9!x7Lp", "blood type O", "784-1988-1234567-1"]
    labels = cluster_strings(dense + noise, eps=0.5, min_samples=3)
    assert len(set(labels[:4])) == 1 and labels[0] >= 0 and labels[4:] == [-1, -1, -1]
    lib = FeatureLibrary.prior()
    leaks = [Leak("email", v, f'"email": "{v}"') for v in dense] + [
        Leak("password", "Zq9!x7Lp", 'pw = "Zq9!x7Lp"')
    ]
    out = update_library(lib, leaks, SpanScorer(), eps=0.5, min_samples=3)
    assert out["fragments_kept"] == 4 and out["added"]["email"]["fragments"] == 4
    assert set(dense) <= set(lib.fragments["email"])
    assert "Zq9!x7Lp" not in lib.fragments["password"]
    assert '"email": "<EMAIL>"' in lib.templates["email"]  # the 4 templates collapse to one


# --------------------------------------------------------------------------- OpenAI HTTP backend


class _Server:
    def __init__(self, status=(200,)):
        self.requests: list[dict] = []
        self.statuses = list(status)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep the test output clean
                pass

            def _reply(self, code, obj, headers=None):
                data = json.dumps(obj).encode()
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(200, {"object": "list", "data": [{"id": "privcode-premium"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(
                    {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
                )
                code = server.statuses.pop(0) if len(server.statuses) > 1 else server.statuses[0]
                if code == "spent":  # the PAC ensemble's budget: a 429 no wait can mend
                    err = {"message": "spent", "type": "x", "code": "privacy_budget_exhausted"}
                    return self._reply(429, {"error": err})
                if code == 429:
                    server.retry_after_at = time.monotonic()
                    return self._reply(
                        429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}
                    )
                if code != 200:
                    return self._reply(code, {"error": {"message": "nope", "type": "x"}})
                text = f"echo:{body.get('seed')}"
                if self.path.endswith("/chat/completions"):
                    return self._reply(200, {"choices": [{"message": {"content": text}}]})
                self._reply(200, {"choices": [{"text": text, "index": 0}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_openai_backend_request_shape(monkeypatch):
    monkeypatch.setenv("PROBE_TEST_KEY", "k-secret-1")
    with _Server() as srv:
        b = OpenAIBackend(srv.url, api_key_env="PROBE_TEST_KEY", concurrency=2)
        assert b.model == "privcode-premium"
        out = b.complete(["p0", "p1"], max_tokens=7, temperature=0.5, n=2, seed=10)
        assert out == [["echo:10", "echo:11"], ["echo:12", "echo:13"]]
        assert len(srv.requests) == 4
        for r in srv.requests:
            assert r["path"] == "/v1/completions" and r["auth"] == "Bearer k-secret-1"
            assert set(r["body"]) == {"model", "prompt", "max_tokens", "temperature", "seed"}
            assert r["body"]["model"] == "privcode-premium" and r["body"]["max_tokens"] == 7
        assert sorted(r["body"]["prompt"] for r in srv.requests) == ["p0", "p0", "p1", "p1"]
        chat = OpenAIBackend(srv.url + "/v1", model="m", api_key_env="PROBE_TEST_KEY", chat=True)
        assert chat.complete(["hi"], max_tokens=3, temperature=0.0, seed=1) == [["echo:1"]]
        assert srv.requests[-1]["path"] == "/v1/chat/completions"
        assert srv.requests[-1]["body"]["messages"] == [{"role": "user", "content": "hi"}]
        assert "k-secret-1" not in json.dumps(b.describe())


@pytest.mark.heavy
def test_openai_backend_retries_and_errors(monkeypatch):
    monkeypatch.delenv("PROBE_TEST_KEY", raising=False)
    with _Server(status=(503, 200)) as srv:
        b = OpenAIBackend(srv.url, model="m", api_key_env="PROBE_TEST_KEY", backoff_s=0.01)
        assert b.complete(["x"], max_tokens=2, temperature=0.0) == [["echo:0"]]
        assert srv.requests[-1]["auth"] is None  # unset variable: no header
    with _Server(status=(400,)) as srv:  # e.g. prompt over the context: empty, counted
        b = OpenAIBackend(srv.url, model="m", api_key_env="PROBE_TEST_KEY", backoff_s=0.01)
        assert b.complete(["x", "y"], max_tokens=2, temperature=0.0) == [[""], [""]]
        assert b.describe()["failed_requests"] == 2 and len(srv.requests) == 2
        strict = OpenAIBackend(srv.url, model="m", api_key_env=None, skip_invalid=False)
        with pytest.raises(BackendError, match="HTTP 400: nope"):
            strict.complete(["x"], max_tokens=2, temperature=0.0)
    with _Server(status=(401,)) as srv:
        b = OpenAIBackend(srv.url, model="m", api_key_env="PROBE_TEST_KEY", backoff_s=0.01)
        with pytest.raises(BackendError, match=r"HTTP 401.*PROBE_TEST_KEY"):
            b.complete(["x"], max_tokens=2, temperature=0.0)
        assert len(srv.requests) == 1  # 4xx is not retried
    with _Server(status=(429, 200)) as srv:  # a rate limit: waits Retry-After, not the backoff
        b = OpenAIBackend(srv.url, model="m", api_key_env=None, backoff_s=0.01)
        assert b.complete(["x"], max_tokens=2, temperature=0.0) == [["echo:0"]]
        assert time.monotonic() - srv.retry_after_at >= 0.9 and len(srv.requests) == 2
    with _Server(status=("spent",)) as srv:
        b = OpenAIBackend(srv.url, model="m", api_key_env=None, backoff_s=0.01, skip_invalid=False)
        with pytest.raises(BackendError, match="HTTP 429: spent"):
            b.complete(["x"], max_tokens=2, temperature=0.0)
        assert len(srv.requests) == 1  # not retried


def test_cli_probe_against_endpoint(tmp_path, capsys):
    import argparse

    from privcode.audit.probe.cli import add_probe_parser
    from privcode.data.records import write_records

    data = tmp_path / "run" / "data" / "train.jsonl"
    data.parent.mkdir(parents=True)
    write_records(_corpus(), data)
    parser = argparse.ArgumentParser()
    add_probe_parser(parser.add_subparsers(dest="cmd"))
    with _Server() as srv:
        args = parser.parse_args(
            [
                "probe",
                "--endpoint",
                srv.url,
                "--data",
                str(data),
                "--scenarios",
                "web",
                "--attributes",
                "email,username",
                "--questions",
                "1",
                "--tests",
                "1",
                "--json",
            ]
        )
        assert args.func(args) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["responses"] == 2 and s["backend"]["kind"] == "openai"
    assert (tmp_path / "run" / "audit" / "probe" / "probe_leaks.json").is_file()


# --------------------------------------------------------------------------- HF backend


def test_hf_backend_ci_model_one_question(ci_base_cache, tmp_path):
    from privcode.audit.probe import HFBackend
    from privcode.audit.probe.update import CausalLMScorer, divide
    from privcode.models.loading import resolve_model_path

    path = resolve_model_path("ci", cache_dir=ci_base_cache, progress=False)
    backend = HFBackend(path)
    outs = backend.complete(["def add(a, b):"], max_tokens=8, temperature=0.8, n=2, seed=1)
    assert len(outs) == 1 and len(outs[0]) == 2
    assert outs == backend.complete(["def add(a, b):"], max_tokens=8, temperature=0.8, n=2, seed=1)
    s = run_probe(
        backend,
        _corpus(),
        out_dir=tmp_path,
        scenarios=["web"],
        attributes=["email"],
        n_questions=1,
        n_tests=1,
        code_max_tokens=24,
        test_max_tokens=32,
        public_model=str(path),
    )
    assert s["responses"] == 1 and 0 <= s["accepted"] <= 1
    assert 0 <= s["confirmed"]["instances"] <= s["funnel"]["email"]["candidates"] + 10
    for cat, entry in s["metrics"].items():
        for key, v in entry.items():
            if key != "responses" and v["rate"] is not None:
                assert 0.0 <= v["rate"] <= 1.0, (cat, key)
    scorer = CausalLMScorer(path)
    leak = Leak("email", LEAK_EMAIL, f'contact_email = "{LEAK_EMAIL}"')
    scored = scorer.score(leak.context, (17, 17 + len(LEAK_EMAIL)))
    assert scored and all(s >= 0 for _, _, s in scored)
    template, fragments = divide(leak, scored)
    assert template is None or "<EMAIL>" in template
    assert all(f in LEAK_EMAIL for f in fragments)


def test_code_is_not_mistaken_for_biometric_data():
    """Seen in the demo: the key `dir is None` joined to "dirisnone" matched "iris", and the
    value `return 1` passed the free-text format check."""
    from privcode.audit.probe.attribute_keys import attribute_for_key
    from privcode.audit.probe.judge import VALIDATORS

    assert attribute_for_key("dir is None") is None
    assert attribute_for_key("iris_code") == "biometric"
    assert attribute_for_key("dna") == "biometric"
    assert not VALIDATORS["biometric"]("return 1")
    assert not VALIDATORS["biometric"]("if dir is None")
    assert VALIDATORS["biometric"]("blood type O negative")


def test_audit_stage_probes_the_configured_scenarios(monkeypatch, tmp_path):
    """audit.probe_scenarios reaches run_probe (empty: all six scenarios, 32 pairs)."""
    import privcode.audit.run as audit_run
    from privcode.audit.run import _probe
    from privcode.config import load_config

    seen = {}

    def fake_probe(backend, refs, **kw):
        seen.update(kw)
        return {"metrics": {}, "confirmed": {}}

    monkeypatch.setattr(audit_run, "run_probe", fake_probe)
    monkeypatch.setattr(audit_run, "HFBackend", lambda path: ScriptedBackend([]))
    monkeypatch.setattr(audit_run, "read_records", lambda path: [])
    run = {"train": tmp_path / "t.parquet", "base": tmp_path / "base"}
    for scenarios, expected in (([], None), (["game", "web"], ("game", "web"))):
        cfg = load_config(None, overrides=[f"audit.probe_scenarios=[{','.join(scenarios)}]"])
        _probe(tmp_path / "m", run, tmp_path / "probe", cfg)
        assert seen["scenarios"] == expected
    assert len(build_questions(resolve_scenarios(None), ATTRIBUTES, 1, random.Random(0))) == 32
