"""The recipe and its rules: the YAML document turned into typed objects (:mod:`.document`), then what each rule
selects, side by side for both formats: in an EXL3 checkpoint's modules (:mod:`.exl3_rules`, the build's
preflight) and among a GGUF model's llama.cpp tensor names (:mod:`.gguf_rules`, shared by build and audit).
"""
