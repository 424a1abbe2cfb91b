"""Transfer learning with BatchNormalization under gradient accumulation.

A Keras application backbone (MobileNet, `weights=None`: offline) nested in a
classifier, fine-tuned on scikit-learn's bundled handwritten digits (upscaled
to 32 x 32 RGB) with micro-batches of 8 accumulated 4 at a time.
`tfaccum.convert_batch_norm` makes each of the backbone's BatchNormalization
layers pool its statistics over the whole window, as at batch 32.

First one window, three ways, to show what the conversion changes: the stem
normalisation's moving statistics after batch 32, after 4 x 8 accumulated
with converted layers (equal), and with plain BatchNormalization (updated per
micro-batch of 8). The moving statistics are updated by the forward passes,
so that window does not depend on the optimizer: plain SGD keeps it quick
(Adam's slots double the first trace). Then it goes on fine-tuning the
converted model with Adam.

    python examples/transfer_learning_bn.py [--epochs 3] [--samples 1400] [--logdir runs/bn]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfaccum  # noqa: E402
from tfaccum import GradientAccumulationCallback  # noqa: E402


def load_data():
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    images = tf.image.resize(np.repeat(images, 3, axis=-1), (32, 32)).numpy()
    labels = digits.target.astype("int32")
    return (images[:1400], labels[:1400]), (images[1400:], labels[1400:])


def build_model(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras.applications.MobileNet(
        input_shape=(32, 32, 3), alpha=0.25, include_top=False, weights=None)
    inputs = keras.Input((32, 32, 3))
    features = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(10)(features))


def compile_model(model, optimizer="sgd"):
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def stem_statistics(model):
    layer = next(layer for layer in model._flatten_layers(recursive=True)
                 if layer.name == "conv1_bn")
    return np.concatenate([np.asarray(layer.moving_mean), np.asarray(layer.moving_variance)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="of fine-tuning (0: none)")
    parser.add_argument("--samples", type=int, default=1400, help="training images (of 1,400)")
    parser.add_argument("--logdir", default=None, help="TensorBoard log directory")
    args = parser.parse_args()
    (x, y), validation = load_data()
    x, y = x[:args.samples], y[:args.samples]

    window = (x[:32], y[:32])
    large = compile_model(build_model())
    large.fit(*window, batch_size=32, epochs=1, shuffle=False, verbose=0)
    converted = compile_model(tfaccum.convert_batch_norm(build_model()))
    accumulation = GradientAccumulationCallback(
        accumulation_steps=4, verbose=1,
        log_dir=os.path.join(args.logdir, "mobilenet-4x8") if args.logdir else None)
    converted.fit(*window, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[accumulation])
    plain = compile_model(build_model())
    plain.fit(*window, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    reference = stem_statistics(large)
    converted_difference = float(np.abs(stem_statistics(converted) - reference).max())
    plain_difference = float(np.abs(stem_statistics(plain) - reference).max())
    print("One window of 32 samples: the stem BatchNormalization's moving statistics")
    print(f"  converted, 4 x 8 accumulated vs batch 32: {converted_difference:.2e}")
    print(f"  plain BatchNormalization, 4 x 8 vs batch 32: {plain_difference:.2e}")
    if converted_difference > 1e-4:
        raise SystemExit("the converted layers did not pool the window's statistics")

    if args.epochs:
        print(f"Fine-tuning the converted model for {args.epochs} epochs ...")
        model = compile_model(converted, keras.optimizers.Adam(1e-3))
        model.fit(x, y, batch_size=8, epochs=args.epochs, validation_data=validation,
                  verbose=2, callbacks=[accumulation])
        _, accuracy = model.evaluate(*validation, verbose=0)
        print(f"optimizer updates {accumulation.optimizer_steps}, micro-steps "
              f"{accumulation.micro_steps}; validation accuracy {accuracy:.4f}")
    if args.logdir:
        print(f"Summaries written to {args.logdir}: open TensorBoard's Accumulation tab.")


if __name__ == "__main__":
    main()
