"""ResNet training on MindSpore: networks, data, schedules and the glue the entry points compose."""
