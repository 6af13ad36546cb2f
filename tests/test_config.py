"""Options are checked at attach(): the wrong type or value is an error there that names the
option (or the environment variable that set it) and says what is expected."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest
from torch import nn

import gradmon
from gradmon import config
from gradmon.config import Config


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("option, wrong, expected", [
    ("disable", "false", "True or False"), ("activations", "no", "True or False"),
    ("grad_flow", 1, "True or False"), ("local_view", "yes", "True or False"),
    ("every", True, "an integer"), ("every", 2.0, "an integer"), ("port", "9400", "an integer"),
    ("connection_timeout", "10", "a number"), ("final_scrape_timeout", False, "a number"),
    ("labels", "run_id=x", "a dict of str keys to str values"), ("labels", {"run_id": 42}, "str values"),
    ("labels", [("run_id", "x")], "a dict"), ("include", [3], "a string"), ("layer_types", [3], "a class"),
    ("name", 5, "a string"), ("addr", 2130706433, "a string"), ("on_nonfinite", 3, "a callable"),
])
def test_a_value_of_the_wrong_type_is_a_type_error_naming_the_option_and_the_expected_type(option, wrong, expected):
    with pytest.raises(TypeError) as err:
        gradmon.attach(mlp(), **{option: wrong})
    message = str(err.value)
    assert f"option {option!r} must be" in message and expected in message and "; got " in message


@pytest.mark.parametrize("field", [f.name for f in fields(Config)])
def test_every_option_refuses_a_value_of_no_sensible_type(field):
    # a new option is checked by declaring it; this fails if one ever is not
    with pytest.raises((TypeError, ValueError), match=f"option {field!r}"):
        gradmon.attach(mlp(), **{field: object()})


@pytest.mark.parametrize("key, why", [
    ("bad-name", "not a valid Prometheus label name"), ("1st", "not a valid Prometheus label name"),
    ("", "not a valid Prometheus label name"), ("__meta", "not starting with '__'"),
    ("run id", "not a valid Prometheus label name"),
    ("model", "used by gradmon"), ("rank", "used by gradmon"), ("layer", "used by gradmon"),
    ("job", "used by gradmon or Prometheus"), ("le", "used by gradmon or Prometheus"),
])
def test_label_names_must_be_valid_and_not_gradmons_own(key, why):
    with pytest.raises(ValueError, match=f"option 'labels' key {key!r} .*{why}"):
        gradmon.attach(mlp(), labels={key: "x"})


def test_valid_labels_are_accepted():
    labels = {"run_id": "exp-42", "_team": "llm", "Stage2": ""}
    assert config.resolve({"labels": labels}, environ={}).labels == labels


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" On ", True),
    ("0", False), ("false", False), ("False", False), ("NO", False), ("off", False),
])
def test_booleans_from_the_environment_accept_the_usual_spellings(raw, expected):
    for name in ("activations", "grad_flow", "log_every_incident"):
        assert getattr(config.resolve({}, environ={config.env_var(name): raw}), name) is expected


@pytest.mark.parametrize("var, raw, message", [
    ("GRADMON_EVERY", "0", "GRADMON_EVERY=0: option 'every' must be a positive integer"),
    ("GRADMON_EVERY", "often", "GRADMON_EVERY=often: must be an integer"),
    ("GRADMON_PORT", "70000", "GRADMON_PORT=70000: option 'port' must be in 0..65535"),
    ("GRADMON_ACTIVATIONS", "maybe", "GRADMON_ACTIVATIONS=maybe: must be one of 1/0, true/false, yes/no, on/off"),
    ("GRADMON_DISABLE", "maybe", "GRADMON_DISABLE=maybe: must be one of"),
    ("GRADMON_LABELS", "run_id", "GRADMON_LABELS=run_id: must be comma-separated key=value pairs"),
    ("GRADMON_LABELS", "job=x", "GRADMON_LABELS=job=x: option 'labels' key 'job' is used by gradmon"),
    ("GRADMON_CONNECTION_TIMEOUT", "0.1", "GRADMON_CONNECTION_TIMEOUT=0.1: option 'connection_timeout'"),
])
def test_a_bad_value_from_the_environment_names_the_variable(monkeypatch, var, raw, message):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError) as err:
        gradmon.attach(mlp(), port=0)
    assert message in str(err.value)


def test_an_error_in_a_keyword_option_does_not_blame_the_environment():
    with pytest.raises(ValueError) as err:
        gradmon.attach(mlp(), every=0)
    assert "GRADMON_" not in str(err.value) and "option 'every'" in str(err.value)


def test_secrets_are_never_echoed_in_errors(monkeypatch):
    with pytest.raises(TypeError) as err:
        gradmon.attach(mlp(), basic_auth_user="prom", basic_auth_password=8675309)
    assert "8675309" not in str(err.value) and "'basic_auth_password'" in str(err.value)


def test_every_option_but_code_only_ones_has_an_environment_variable():
    code_only = {name for name, hint in typing.get_type_hints(Config).items()
                 if hint is typing.Any or "Callable" in str(hint)}
    assert set(config._ENV_PARSERS) == {f.name for f in fields(Config)} - code_only
    assert code_only == {"registry", "scaler", "on_nonfinite"}


# --- text that is not UTF-8 ----------------------------------------------------------------
# Bytes in an environment variable that are not UTF-8 reach Python as lone surrogates
# (os.environ decodes with surrogateescape); a string built in code can hold them too.

@pytest.mark.parametrize("option, value", [
    ("labels", {"run_id": "exp-\udce9"}), ("name", "gpt\udcff"), ("include", ("blocks.\ud800*",)),
    ("ui_hosts", ("proxy\udce9",))])
def test_text_that_cannot_be_utf8_is_a_value_error_naming_the_option(option, value):
    with pytest.raises(ValueError, match=f"option {option!r} must be valid UTF-8 text"):
        gradmon.attach(mlp(), port=0, **{option: value})


def test_text_that_is_utf8_but_not_ascii_is_accepted():
    cfg = config.resolve({"labels": {"team": "équipe-北京"}, "name": "modèle"}, environ={})
    assert cfg.labels["team"] == "équipe-北京" and cfg.name == "modèle"


def _attach_in_a_child(env: typing.Dict[bytes, bytes]) -> str:
    """attach() in a new interpreter whose environment holds ``env`` as raw bytes; its error."""
    import os
    import subprocess
    import sys
    code = ("import gradmon, torch\n"
            "try:\n"
            "    gradmon.attach(torch.nn.Linear(2, 2), port=0, addr='127.0.0.1')\n"
            "    print('attached')\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    environ = {k: v for k, v in os.environb.items() if not k.startswith(b"GRADMON_")}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, timeout=120)
    return out.stdout.decode("utf-8", "backslashreplace")


def test_a_password_whose_bytes_are_not_utf8_is_a_value_error_naming_the_variable_not_a_unicode_error():
    said = _attach_in_a_child({b"GRADMON_BASIC_AUTH_USER": b"prom", b"GRADMON_BASIC_AUTH_PASSWORD": b"p\xe4ss"})
    assert said.startswith("ValueError gradmon: GRADMON_BASIC_AUTH_PASSWORD=<hidden>: option 'basic_auth_password' "
                           "must be valid UTF-8 text"), said
    assert "\\udce4" not in said  # nothing of the secret is shown


def test_a_label_whose_bytes_are_not_utf8_is_a_value_error_naming_the_variable():
    said = _attach_in_a_child({b"GRADMON_LABELS": b"run_id=exp-\xe9"})
    assert said.startswith("ValueError gradmon: GRADMON_LABELS=run_id=exp-\\udce9: option 'labels' "
                           "must be valid UTF-8 text"), said
