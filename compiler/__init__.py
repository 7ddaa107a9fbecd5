"""Kiln's build side: recipe -> checkpoint -> ONNX (+ variants) -> validated artifact folder."""
