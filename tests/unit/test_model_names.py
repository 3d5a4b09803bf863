"""Which model names a request may send (--served-model-name A B, --accept-any-model-name)."""

from __future__ import annotations

import pytest

from jaxserve.server.errors import ApiError
from jaxserve.server.model_names import ModelNames


def test_served_names_generic_names_and_omitted_model_are_accepted():
    names = ModelNames(("smollm2", "llama3", "mymodel"))
    for name in (None, "smollm2", "llama3", "mymodel", "default", "null"):
        names.check(name)  # FastDeploy's examples send "default" and "null"
    with pytest.raises(ApiError) as e:
        names.check("gpt-4")
    assert e.value.status == 404 and e.value.param == "model" and e.value.code == "model_not_found"
    assert "`gpt-4`" in e.value.message and "`smollm2`, `llama3`, `mymodel`" in e.value.message


def test_accept_any_and_cards():
    names = ModelNames(("smollm2", "alias"), accept_any=True)
    names.check("anything at all")
    assert names.primary == "smollm2" and ModelNames.of("x").names == ("x",) and ModelNames.of(names) is names
    cards = names.cards(created=5, max_model_len=2048)
    assert [c["id"] for c in cards["data"]] == ["smollm2", "alias"]
    assert all(c["root"] == "smollm2" and c["max_model_len"] == 2048 for c in cards["data"])
    with pytest.raises(ValueError):
        ModelNames(())


def test_lora_adapters_are_models_of_their_own_on_generation_routes():
    names = ModelNames(("smollm2",), adapters=(("sql", "/adapters/sql", None), ("poet", "/adapters/poet", "base")))
    assert names.lora("sql") == "sql" and names.lora("smollm2") is None and names.lora(None) is None
    assert names.lora("default") is None  # the generic names are the base model
    assert names.reported("poet") == "poet" and names.reported("smollm2") == "smollm2"
    assert names.reported(None) == "smollm2" and names.reported("default") == "smollm2"
    with pytest.raises(ApiError) as e:
        names.lora("nope")
    assert e.value.status == 404 and "`nope`" in e.value.message
    with pytest.raises(ApiError) as e:  # routes that serve the base model only (embeddings, tokenize, ...)
        names.check("sql")
    assert e.value.status == 400 and e.value.param == "model" and "LoRA adapter" in e.value.message
    cards = names.cards(created=5, max_model_len=512)["data"]
    assert [c["id"] for c in cards] == ["smollm2", "sql", "poet"]
    assert (cards[1]["root"], cards[1]["parent"]) == ("/adapters/sql", "smollm2")
    assert names.card("poet", 5, 512)["root"] == "/adapters/poet"
    assert names.card("poet", 5, 512)["parent"] == "base"  # vLLM's base_model_name
