"""Chat templates the tests render with SmolLM2's tokenizer."""

# A RAG template in the shape of Command-R's and Granite's: the documents before the turns.
RAG_TEMPLATE = ("{% if documents %}<|im_start|>system\n{% for d in documents %}[{{ loop.index }}] {{ d.title }}: "
                "{{ d.text }}\n{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
