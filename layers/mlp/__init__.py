"""megamoe.layers.mlp.dense: the MLP blocks (dense, mixture of experts) and the MoE parts."""
