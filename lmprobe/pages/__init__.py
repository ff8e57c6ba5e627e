"""Pages a person looks at: the dataset report (``report``) and the SAE feature cache and browser (``features``)."""
