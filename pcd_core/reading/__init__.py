"""One read of the model: the decoding rounds, the readout of label probabilities, the packed read path, open-field generation and chat."""
