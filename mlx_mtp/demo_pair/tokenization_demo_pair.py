"""The demo pair's tokenizer: ``tokenizer.json`` exactly as written (byte-level BPE, GPT-2 split).

transformers >= 5.2x hands every ``model_type: qwen3_5`` checkpoint its own Qwen3.5 tokenizer class,
which keeps only the vocabulary and merges of ``tokenizer.json`` and rebuilds the rest (NFC and the
Qwen pre-tokenizer regex), so this pair's text would be split differently from how it was trained.
The ``auto_map`` entry in ``tokenizer_config.json`` that names this class takes the loader off that
path (without ``trust_remote_code`` it falls back to ``tokenizer_class``, a plain fast tokenizer
over the file); with ``trust_remote_code=True`` this class is that plain fast tokenizer.
"""

from transformers import PreTrainedTokenizerFast


class DemoPairTokenizer(PreTrainedTokenizerFast):
    pass
