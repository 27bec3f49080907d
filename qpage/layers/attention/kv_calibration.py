"""Text for measuring the mean key and value of each channel when a quantized KV cache starts
(FP8 with per-token scales, int8, int4, k8v4).

The means only center K and V before they are quantized (``LayerKV.k_shift``), which
is exact for attention whatever their values; a few hundred tokens of ordinary prose
give stable means. The text is written for qpage (no external source).
"""

CALIBRATION_TEXT = """\
The town sat where the river bent twice before reaching the sea, and for most of its history \
the bend decided everything: where the mills stood, where the bridges could be built, and \
which families grew rich from the tolls. In the spring the water rose quickly, and the older \
houses along the bank still carry marks showing how high each flood reached.

A good recipe for bread needs only four things: flour, water, salt and time. Mix the flour \
and water first and let them rest for half an hour; the dough becomes smoother without any \
work at all. Then add the salt and the yeast, fold the dough every thirty minutes for two \
hours, shape it gently, and bake it in a very hot oven until the crust is dark brown.

Question: Why does the moon show phases? Answer: The moon does not make its own light. Half \
of it is always lit by the sun, and as it travels around the earth over about twenty-nine \
days we see different fractions of that lit half, from a thin crescent to a full disk.

The committee met on Tuesday to review the budget for the coming year. Spending on roads \
will rise by four percent, the library will open two more evenings each week, and a new \
program will help small businesses install solar panels. Several members asked for clearer \
reports on how the money is used, and the chair agreed to publish them every quarter.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / len(values) if values else 0.0

In 1854 a doctor in London traced an outbreak of cholera to a single water pump by marking \
every death on a map of the streets. When the handle of the pump was removed, the number of \
new cases fell, and his map became one of the first examples of what we now call epidemiology.

She closed the notebook, looked out at the rain, and decided that the letter could wait \
until morning. There would be time to explain everything then, slowly, in the right order.
"""
