"""An info gauge (vLLM's lora_requests_info): its labels carry the values, escaped, and its value
is the scrape's time."""

from __future__ import annotations

import re
import time

from jaxserve.server.metrics import Metrics


def test_info_gauge_renders_labels():
    m = Metrics("m")
    m.info("lora_requests_info", "LoRA adapters.", lambda: {"max_lora": "2", "running_lora_adapters": 'a,b"c',
                                                              "waiting_lora_adapters": ""})
    before = time.time()
    text = m.render()
    assert "# TYPE jaxserve:lora_requests_info gauge" in text
    line = next(x for x in text.splitlines() if x.startswith("jaxserve:lora_requests_info{"))
    labels, value = re.fullmatch(r"jaxserve:lora_requests_info(\{.*\}) (\S+)", line).groups()
    assert labels == '{max_lora="2",running_lora_adapters="a,b\\"c",waiting_lora_adapters=""}'
    assert before <= float(value) <= time.time()
