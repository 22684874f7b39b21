"""A byte-level BPE tokenizer for Python source, trained with the ``tokenizers`` library.

Special tokens: ``<unk>`` 0, ``<s>`` 1 (BOS, prepended by the post-processor), ``</s>`` 2 (end of text: joins
files in the corpus and ends generation). Byte-level, so every string round-trips; spaces are not prefixed, so
indentation runs become tokens of their own.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def train_bpe_tokenizer(files: list[str], vocab_size: int):
    """A ``tokenizers.Tokenizer`` trained on ``files`` (paths) with ``vocab_size`` entries in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(files, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    return tokenizer


def hf_tokenizer_files(tokenizer, directory: str, model_max_length: int) -> None:
    """Writes tokenizer.json plus tokenizer_config.json / special_tokens_map.json so that transformers'
    ``AutoTokenizer`` loads it as a fast tokenizer."""
    import json
    import os

    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(dict(special, tokenizer_class="PreTrainedTokenizerFast", model_max_length=model_max_length,
                       add_bos_token=False, clean_up_tokenization_spaces=False), f, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
