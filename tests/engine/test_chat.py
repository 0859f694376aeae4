"""A model's tokenizer as plain data: its files make, elsewhere, a tokenizer that renders, encodes and decodes
exactly as the original (what the Ray proxy uses instead of a pickled live tokenizer)."""

from __future__ import annotations

from transformers import AutoTokenizer

from whitney.engine.families import chat


def test_a_tokenizer_rebuilt_from_its_files_answers_as_the_original(tiny_llama):
    original = AutoTokenizer.from_pretrained(tiny_llama)
    files = chat.tokenizer_files(original)
    assert all(isinstance(name, str) and isinstance(data, bytes) for name, data in files.items())
    rebuilt = chat.tokenizer_from_files(files)
    assert rebuilt is not original
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界 <|im_end|>"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again"}]
    for generation_prompt in (True, False):
        assert chat.render_chat(rebuilt, "m", messages, generation_prompt, mark_assistant=True) == \
            chat.render_chat(original, "m", messages, generation_prompt, mark_assistant=True)
    text = "Ünïcode, spaces  and\nnew lines; <|im_start|>special"
    tokens = chat.encode(original, text)
    assert chat.encode(rebuilt, text) == tokens
    assert chat.decode(rebuilt, [tokens, tokens[:3]], False) == chat.decode(original, [tokens, tokens[:3]], False)
    assert chat.decode(rebuilt, [tokens], True) == chat.decode(original, [tokens], True)
