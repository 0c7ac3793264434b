"""Input data's building blocks, composed by src/dataset.py: sources (CIFAR-10 binary files, class
folders, MindRecord shards), per-sample transforms and policies, keyed samplers, batch assembly,
JPEG decoding, erasing and mixing, the input stage and its numpy twin, unreadable samples; and the
generated sample and photo datasets."""
