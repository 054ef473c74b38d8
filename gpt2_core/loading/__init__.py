"""Before chapter 1: from checkpoint files to a ``GPT2Model`` (config, weights, tokenizer), with no chapter's code.

* ``config``: the hyper-parameters of an HF ``config.json``;
* ``safetensors_io``, ``torch_bin``: reading ``model.safetensors`` and ``pytorch_model.bin`` (no torch, no pickle run);
* ``weights``: ``load_model`` / ``random_model`` -> ``GPT2Model``; ``hub``: real checkpoints by name;
* ``tokenizer``: text <-> token ids, and the folder's chat template; ``chat_template``: a conversation -> prompt text
  with that template, in a Jinja2 sandbox; ``memory``: how much memory the machine has left.
"""
