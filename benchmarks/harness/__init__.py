"""The shared harness of the benchmark scripts in ``benchmarks/`` (see benchmarks/README.md).

Scripts import it as ``harness.<module>`` (they run with ``benchmarks/`` on ``sys.path``):

* ``common``: machine description, result JSON files under ``benchmarks/results/``, tables;
* ``settings``: the checkpoint settings compared, and ``--settings`` parsing;
* ``restarts``: the restart experiment (uninterrupted run, noise floor, restarted runs);
* ``tiny_gpt``, ``minilm_finetune``: the two tasks the restart experiment trains;
* ``minilm``: all-MiniLM-L6-v2 loaded offline (needs the ``bench`` extra);
* ``fixture``, ``memory``: the MiniLM + AdamW state of the speed comparison, and RSS probes;
* ``speed_summary``: the speed comparison's rows and tables; ``codec_report``: the codec page;
* ``plots``, ``gpu_page``: pieces of the results page that ``make_results.py`` writes.
"""
