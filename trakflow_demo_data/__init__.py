"""The embedded default that ``trakflow demo``, the ``digits-demo`` flow and the deployments run, shipped with the
package (the checkout's ``examples/`` holds the other runnable examples and the YAML configs that name these):

* :mod:`trakflow_demo_data.digits`: scikit-learn's handwritten digits and a small MLP, and the demo's configs;
* :mod:`trakflow_demo_data.folder_data`: train data that grows, the files of a folder (the nightly deployment).
"""
