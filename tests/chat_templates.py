"""Chat templates for the shipped tiny target (its tokenizer has none): a plain one and one that
opens a ``<think>`` block, written into a copy of the checkpoint."""

import json
import shutil

from stree.tools.demo import TARGET

PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
THINKING = PLAIN.replace("<|assistant|>\n{% endif %}", "<|assistant|>\n<think>\n{% endif %}")


def with_template(tmp_path, template, name):
    """A copy of the shipped target under ``tmp_path / name`` whose tokenizer has ``template``."""
    ckpt = tmp_path / name
    shutil.copytree(TARGET, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return ckpt
