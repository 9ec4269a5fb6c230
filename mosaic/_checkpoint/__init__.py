"""What a checkpoint is: a folder of shards and configs (:mod:`.folder`), the EXL3 rules for its
tensors (:mod:`.exl3`), and the analysis of one checkpoint behind ``mosaic census`` (:mod:`.census_exl3`; a GGUF model's: :mod:`.census_gguf`).

Read-only: nothing here writes a file.
"""
