"""Fine-tune a keras_hub causal language model with gradient accumulation.

Offline by default: a tiny random Llama with a SentencePiece vocabulary
trained here, on real English text that ships inside scikit-learn (its
datasets' descriptions). Trains it twice from the same weights, once with
batch 16 and once with micro-batches of 4 accumulated 4 at a time, and
prints how far apart they end up: the padded tokens are masked, and the
accumulated run is still the large batch, token for token.

    python examples/finetune_causal_lm.py [--epochs 2] [--logdir runs/lm]
    python examples/finetune_causal_lm.py --preset gpt2_base_en   # downloads

With --preset it fine-tunes that keras_hub preset instead (your machine must
be able to download it), accumulated only. With --logdir it writes the
Accumulation dashboard's summaries.
"""

import argparse
import os
import re
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import sklearn  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfaccum import GradientAccumulationCallback  # noqa: E402

SEQUENCE_LENGTH = 32


def load_text(lines=192):
    """Sentences of scikit-learn's bundled dataset descriptions (real text, offline)."""
    text = " ".join(
        path.read_text(encoding="utf-8")
        for path in sorted((Path(sklearn.__file__).parent / "datasets" / "descr").glob("*.rst"))
    )
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text))]
    sentences = [s for s in sentences if 4 <= len(s.split()) <= 24 and s.isascii()]
    return sentences[:lines]


def tiny_llama(texts, seed=0):
    """A 1-layer Llama with a 300-piece vocabulary learnt from `texts`."""
    keras.utils.set_random_seed(seed)
    proto = keras_hub.tokenizers.compute_sentence_piece_proto(
        tf.data.Dataset.from_tensor_slices(texts), vocabulary_size=300)
    tokenizer = keras_hub.models.LlamaTokenizer(proto=proto)
    preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, dropout=0.0)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=preprocessor)


def compile_for_fine_tuning(model):
    model.compile(
        optimizer=keras.optimizers.AdamW(3e-3, weight_decay=0.01, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=False,
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--preset", default=None,
                        help="a keras_hub CausalLM preset to download and fine-tune")
    parser.add_argument("--logdir", default=None, help="TensorBoard log directory")
    args = parser.parse_args()
    texts = load_text()
    accumulation = GradientAccumulationCallback(
        accumulation_steps=4, verbose=1,
        log_dir=os.path.join(args.logdir, "4x4") if args.logdir else None)

    if args.preset:
        model = compile_for_fine_tuning(keras_hub.models.CausalLM.from_preset(args.preset))
        model.fit(texts, batch_size=4, epochs=args.epochs, verbose=2, callbacks=[accumulation])
        print(model.generate("The dataset", max_length=SEQUENCE_LENGTH))
        return

    print(f"Fine-tuning a tiny Llama on {len(texts)} sentences with batch_size=16 ...")
    large = compile_for_fine_tuning(tiny_llama(texts))
    large.fit(texts, batch_size=16, epochs=args.epochs, shuffle=False, verbose=2)
    print("... and with batch_size=4, accumulation_steps=4 ...")
    accumulated = compile_for_fine_tuning(tiny_llama(texts))
    accumulated.fit(texts, batch_size=4, epochs=args.epochs, shuffle=False, verbose=2,
                    callbacks=[accumulation])
    difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                     for a, b in zip(large.get_weights(), accumulated.get_weights()))
    print(f"optimizer updates: {int(large.optimizer.iterations)} (batch 16), "
          f"{accumulation.optimizer_steps} (4 x 4 accumulated)")
    print(f"tokens per update: {accumulation.items // accumulation.optimizer_steps}"
          f" on average; samples {accumulation.samples}, tokens {accumulation.items}")
    print(f"largest weight difference: {difference:.2e}")
    if difference > 1e-4:
        raise SystemExit("accumulated fine-tuning diverged from the large batch")
    if args.logdir:
        print(f"Summaries written to {args.logdir}: open TensorBoard's Accumulation tab.")


if __name__ == "__main__":
    main()
