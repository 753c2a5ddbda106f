"""A step's model FLOPs as PaLM counts them (appendix B), for MFU."""

import keras

from training.models import transformer
from training.models.flops import model_flops_per_example

LAYERS, D_MODEL, VOCAB, SEQ = 2, 64, 256, 128


def test_the_transformers_flops_are_6n_plus_attention_and_a_frozen_weight_4():
    """6 per weight and token but the token table when it is only looked up (untied), plus
    12 · layers · d_model · seq per token for attention; a frozen weight 4 (no gradient of
    its own)."""
    attention = 12 * LAYERS * D_MODEL * SEQ
    for tied, lookup in ((False, VOCAB * D_MODEL), (True, 0)):
        model = transformer.build(
            layers=LAYERS,
            d_model=D_MODEL,
            heads=4,
            d_ff=256,
            vocab_size=VOCAB,
            seq_len=SEQ,
            tie_embeddings=tied,
        )
        weights = model.count_params() - lookup
        assert model_flops_per_example(model, SEQ) == SEQ * (6 * weights + attention)
        head = model.get_layer("token_embedding" if tied else "lm_head")
        head.trainable = False
        frozen = head.embeddings.numpy().size
        assert model_flops_per_example(model, SEQ) == SEQ * (6 * weights - 2 * frozen + attention)
    keras.backend.clear_session()
