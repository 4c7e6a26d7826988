"""Train data that grows, :mod:`trakflow_demo_data.folder_data` (shipped with the package), under its former import
path: configs that name ``examples.folder_data:train_folder`` keep working from the checkout."""

from trakflow_demo_data.folder_data import (  # noqa: F401
    SUFFIXES,
    TRAIN_DIR_ENV,
    load_folder,
    part_files,
    save_part,
    train_dir,
    train_folder,
)
