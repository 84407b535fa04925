"""Our default policy "waterfill": remaining-work-weighted goodput, local search + genetic refinement.

Pollux (OSDI'21) maximises a fairness power mean of speedups with a genetic search over
(jobs x nodes) matrices, about a second per round here (several on the artifact). This policy
maximises a *weighted sum* of speedups (Smith's rule for mean completion time with elastic,
sub-linear speedups):

    maximise  sum_j w_j * U(s_j(r_j)) - sum_{j restarted} w_j * k_j,
    w_j = (1 + R_j / theta) ** -alpha / s_j(f_j) ** gamma,
    k_j = U(s_j(r_j^cur)) * c_j,  or  max(U(s_j(r_j^cur)) * c_j, U(s_j(r_j)) * g_j) if it grows,
    c_j = 30 s * (restarts_j + 1) / (age_j + 30 s),   g_j = 30 s / min(H * 60 s, T_j),
    s.t.      sum_j r_j <= GPUs,  min_j <= r_j <= max_j,

where ``s_j(r)`` is the job's goodput speedup on ``r`` replicas packed on
``ceil(r / gpus_per_node)`` nodes (from its own goodput model, calibrated where its
application has measured: "Calibration" below), ``R_j`` the job's estimate of
its remaining seconds on one GPU (``JobInfo.remaining_work``: remaining epochs' statistical
progress over its modelled one-GPU goodput; jobs without a model get weight 1), ``f_j`` its
max-min fair share of the GPUs and ``gamma`` = ``future_gamma`` (the speed to come, below),
``U`` the identity (``p = 1``) or a power/log utility, ``c_j`` Pollux's restart penalty
(floored at ``min_restart_cost``) and ``g_j`` the least share of its new speed a running job
pays to grow (``H`` = ``grow_payback`` rounds, ``T_j = R_j / s_j(r_j^cur)`` the job's remaining
time at its current size; both below). ``theta`` is ``sparse_theta`` and ``H`` is
``sparse_payback`` instead while jobs arrive sparsely ("Sparse arrivals" below). With
``weighting="las"`` the weight uses the attained GPU time instead (non-clairvoyant).

Solved by a warm-started local search: start from the current replica counts (no restart for
anyone), admit waiting jobs with one GPU each (from free GPUs, or from the job that loses least),
hand free GPUs out in chunks of up to two nodes to the largest weighted gain per GPU (chunks
step over the dips of non-concave speedup curves), then move chunks from the job losing least to
the job gaining most while that pays. A non-preemptible running job (``JobInfo.preemptible``)
keeps its allocation: the search sizes the other jobs on the GPUs left, and the genetic
refinement below pins it too. Unchanged jobs keep their nodes; placement packs multi-node
jobs on the emptiest nodes, at most one multi-node job per node (interference avoidance), and
best-fits single-node jobs. Cost: a few thousand Python operations per round (milliseconds for
160 jobs on 64 GPUs).

With ``search="genetic"`` (the default) the local-search answer then seeds a genetic refinement
(:mod:`adaptrain.sched._plan`: Pollux's NSGA-II-style search over (jobs x nodes) matrices, on the
weighted sum of speedups above with Pollux's multiplicative restart factor), which replaces it
only when strictly better (the refinement uses ``U`` = identity and ignores
``min_restart_cost``; ``seed``, ``pop_size`` and ``generations`` configure it). The local search
stops in local optima that the genetic search escapes: it places after choosing sizes, so a job
may end up split across nodes, and it never moves a third job to free a whole node. On the
Pollux artifact's workloads 1/3/5/6 the average JCT went from 0.943/1.027/0.929/0.939 to
0.919/0.971/0.886/0.925 x the stored Pollux figure (``benchmarks/results/sched.md``), at
50-80 ms per round on average (at most ~0.4 s; fewer generations beyond 40 jobs).
``genetic_runs`` (default 1) independent searches run side by side (seeds ``seed``,
``seed + 1``, ..., each with its own warm-start population) and the fittest answer is kept;
beyond 40 jobs proportionally fewer run (one from 120 jobs on), bounding the cost per round.
Three runs instead of one gave 0.912/0.967/0.879/0.925 on the workloads above at about three
times the cost, gains of the order of the seed-to-seed noise, so the default is one run
(round 3 in ``benchmarks/results/sched.md``). ``search="local"`` keeps the
millisecond local search alone. Default ``theta`` = 16 h (8 h was best for the local search
alone; with the genetic refinement 16 h was better on all four workloads tried).

Jobs without a remaining-work estimate (no goodput model yet: just submitted) get the largest
weight, 1, as under least-attained-service: a new job is admitted ahead of long-running ones.

Exploration (``explore_beta``, default 0.5; ``None`` turns it off): beyond the largest size a
job has run on (``JobInfo.max_profiled_replicas``, ``r0``) its speedup is only the goodput
model's extrapolation, which, with no multi-node data, dips at the node boundary (e.g. a
learned s(4) = 2.8, s(8) = 2.9, s(12) = 3.6), so a goodput maximiser leaves the job below the
dip for good. Jobs expected to run longer than ``explore_horizon`` (remaining work over the
speedup at ``r0``; default one hour, enough to repay a restart many times) are valued there
optimistically, at least ``s(r0) (r / r0) ** explore_beta``
(:class:`~adaptrain.sched.speedup.ExploringSpeedup`); one round at the larger size measures
it. Same-run effect on workloads 1/3/5/6 (avg JCT / stored Pollux, without -> with): load 0.5
1.021/1.043/1.025/1.010 -> 1.016/1.026/1.006/1.012, load 1.0 0.908/0.989/0.884/0.915 ->
0.903/0.986/0.883/0.914; over all 16 files at loads 0.5-2.0 better on 13 (by 0.1-1.9%), worse
on 3 (by 0.2-1.8%) (``benchmarks/results/sched.md``, session 6). With ``explore_observed``
(default ``True``) the floor's exponent is at most the job's own scaling so far,
``log s(r0) / log r0``: early in training a job may gain little from more GPUs at any size
(yolov3's first epoch: s(4) = 1.14, s(16) = 0.45 once measured), and presuming it scales on at
``explore_beta`` cost it two restarts and a slow round, alone on an idle cluster. Same-run
effect over the 16 files (session 25, with arrivals below): mean 0.888 -> 0.883, better on 10.

Arrivals (:meth:`allocate_job`): a job submitted between two rounds is placed at once on free
GPUs, on one node, at up to :meth:`replica_bound` replicas (a new job's first size), instead of
waiting up to a round; no other job moves. AdaptDL's allocator does the same with Pollux's
``allocate_job`` (one GPU); the artifact simulator behind the stored Pollux figures does not.
Same-run effect over the 16 files (session 25): mean 0.894 -> 0.888 x stored Pollux. Free GPUs
are there for 46-65% of the arrivals at load 0.5 and 22-43% above: elastic jobs fill the rest.

Exploration cap (``explore_growth``, default 4; ``None`` keeps the allocator's): the allocator
caps a job at twice the largest size it has run on (AdaptDL's rule, ``JobInfo.max_replicas``),
so a job that wants 16 GPUs climbs 1 -> 2 -> 4 -> 8 -> 16, a round and a 30 s restart per step.
The cap bounds how far a scheduler trusts a goodput model beyond the sizes it was fitted on; it
is the scheduler's choice, not the job's (AdaptDL's allocator applies it, from the job's hints).
This policy goes up to ``explore_growth`` times the largest tried size (1 -> 4 -> 16), within
the job's ``replica_limit`` and never below ``max_replicas`` (:meth:`replica_bound`; for a
job never run, see the first size below). The goodput model prices the larger size as it does any
other (with the optimistic floor above for long jobs), and the first round there measures it.
Same-run effect on workloads 1/3/5/6 (avg JCT / stored Pollux, 2x -> 4x): load 0.5
1.009/1.019/1.002/0.999 -> 0.946/0.955/0.938/0.951, load 1.0 0.900/0.970/0.891/0.912 ->
0.907/0.947/0.864/0.868, load 1.5 0.843/0.910/0.863/0.869 -> 0.853/0.908/0.855/0.859, load 2.0
0.841/0.897/0.871/0.892 -> 0.851/0.892/0.874/0.895: the mean over the 16 files 0.918 -> 0.898,
better on 11 (by 5-6% at load 0.5), worse on 5 by at most 1.2% (workload-1 at loads 1.0-2.0).
3x and 8x were worse than 4x where tried. The rule is not ours alone to gain from: our Pollux
given the same 4x cap went 0.997 -> 0.939 on workload-3 at load 0.5 (ahead of ours, as under
2x) and to 0.972 on workload-6 at load 1.0, where ours stays 11% ahead
(``benchmarks/results/sched.md``, session 23).

First size (``first_replicas``, default 4; ``None`` keeps the allocator's 1 GPU): a job that
has never run and has no goodput model (``max_profiled_replicas = 0``, a speedup of ``None``
or the :class:`~adaptrain.sched.speedup.LinearSpeedup` guess) may start on up to
``first_replicas`` GPUs, within its ``replica_limit``, instead of one. Its unknown scaling is
valued at ``r ** first_beta`` (default 0.5, :class:`~adaptrain.sched.speedup.PowerSpeedup`)
rather than at the linear guess, so that it takes free GPUs but wins none from measured jobs
on a guess: at light load a job skips the first step of its ramp (4 -> 16 instead of
1 -> 4 -> 16, a round and a restart saved); under congestion it starts on 1 GPU as before.
Its first round measures it at that size. Same-run effect: see ``benchmarks/results/sched.md``,
session 24 (the linear guess itself, ``first_beta = 1``, took GPUs from measured jobs and
lost up to 2% under congestion).

Ramp credit (``ramp_credit``, default 1; ``None`` turns it off): a job held by its exploration
cap (the bound above, below its ``replica_limit``) that wants to be much larger reaches its
size step by step, one round per step (doubling under the allocator's cap). Judged by the
speedup at the cap alone, the first steps of a young job are worth little (its model,
fitted early in training, predicts e.g. s(2) = 1.4) and lose to any donor's restart penalty, so
the job waits at 1 GPU for rounds while its whole ramp waits with it (at load 0.5, cifar10 jobs
waited up to 6 rounds and took 5-30% longer than under Pollux, whose p = -1 mean lifts the
worst-off job). Held back one round, the ramp ``cap, 2 cap, ...`` up to the size ``r_far`` it
would reach comes one round later, which costs about one round at ``s(r_far)`` rather than at
``s(cap)`` (the rounds of a doubling ramp telescope). ``r_far`` is the job's size in a local
search with the caps lifted (up to ``ramp_doublings`` doublings of the tried size, within the
job's limit and the cluster): all ramps compete there with each other and with every other job,
so under congestion they reach little. The one-off gain ``s(r_far) - s(cap)`` of one round is
turned into a rate over the job's restart horizon, as the restart penalty turns its one-off
loss into one: the step to the cap is credited ``ramp_credit * min(1, round_seconds (restarts +
1) / (age + d)) * (s(r_far) - s(cap))`` (:class:`~adaptrain.sched.speedup.RampSpeedup`), about
0.43 of the gain for a job two minutes old and 0.1 for an old, often restarted one. Crediting
each ramp alone against the cheapest GPUs of the plan instead gained 2-5% at load 0.5 but
lost up to 4% under congestion, where every young job counts on the same cheap donor
(``benchmarks/results/sched.md``, session 12). Same-run effect on workloads 1/3/5/6 (avg JCT /
stored Pollux, without -> with): load 0.5 1.016/1.026/1.006/1.012 -> 1.012/1.005/0.989/1.005,
load 1.0 0.903/0.986/0.883/0.914 -> 0.915/0.971/0.878/0.913, load 1.5 0.852/0.919/0.857/0.887
-> 0.855/0.915/0.861/0.866, load 2.0 0.848/0.898/0.862/0.888 -> 0.849/0.895/0.865/0.893: the
mean over the 16 files 0.922 -> 0.918, every load-0.5 file better, the others mixed within the
seed scatter (workload-1 at load 1.0, over three seeds of the genetic search: 0.903 -> 0.911).

Speed to come (``future_gamma``, default 0.5; ``None`` or 0 turns it off): the weight of each
job with a goodput model and a remaining-work estimate is divided by ``s_future **
future_gamma``, ``s_future`` being its speedup at its max-min fair share of the GPUs, each job
capped at its goodput peak within its bound (water-filling). A speedup gain ``ds`` held for
``t`` seconds advances a job by ``ds t`` one-GPU seconds, which shortens its completion by about
``ds t / s_future``, the speed at which it would otherwise have done that work later: a gain is
worth more to a job that cannot run fast later (yolov3, whose goodput peaks near 11x) than to
one that will (imagenet late in training, about 50x on 64 GPUs). The remaining-work weight keeps
the shortest-first order on top. A job just submitted keeps weight 1, so against the measured
jobs (divided by the root of their speed to come, with the default exponent) it is admitted more
readily; dividing it too, by its prior's speed to come, was worse at load 0.5 and better at load
1.0. Same-run effect over the 16 files, seed 0: mean 0.883 -> 0.875, better on 13 files, worse
on 3 by at most 1.3%; over seeds 0 / 1 / 2 the means are 0.875 / 0.876 / 0.878 (were 0.883 /
0.887 / 0.886), and 12 files are <= 0.90 under every seed (were 10). Measured at load 0.5, the
gain falls mostly on the cifar10 and deepspeech2 jobs, less on yolov3. ``future_gamma = 1`` on
the peak speed instead of the fair share gained 1-4% at load 0.5 but lost 5-7% at load 1.0
(``benchmarks/results/sched.md``, session 27).

Growth payback (``grow_payback``, default 3 rounds; ``None`` prices growth by the restart
penalty alone): a running job that grows pays at least ``g = restart_delay / (grow_payback *
round_seconds)`` (1/6 by default) of its new speed, in the local search and in the genetic
fitness (there its restart factor is at most ``1 - g``). Pollux's penalty amortises a restart
over the job's age per restart, minutes to hours for an old job, so an old job with a flat
speedup curve grows into GPUs freed by a completion for a gain of a few percent, and gives them
back at a next arrival: two restarts, 60 s lost, for a round or two at the larger size
(yolov3 on workload-3 at load 0.5: 19 -> 36 -> 20 GPUs over three consecutive rounds). The
restart of a growth is repaid only if the larger size lasts ``restart_delay * s_new / (s_new -
s_old)`` seconds; the floor asks the gain to repay it within ``grow_payback`` rounds.
Admission (a job from 0 GPUs) and shrinking are priced as before. Same-run effect over the
16 files and seeds 0 / 1 / 2: the means are level (0.875 / 0.876 / 0.878 -> 0.875 / 0.876 /
0.877); the seed means are better on 9 files by 0.2-1.9%, the worst ones most (workload-3 at
load 0.5 0.921 -> 0.903, at load 1.0 0.930 -> 0.919; the largest figure over files and seeds
0.938 -> 0.923), and worse on 7 by 0.6-1.7% (three of them at load 1.5); 13 files are <= 0.90
under every seed (were 12). On workload-3 yolov3 restarts 25-32% less often but finishes no
sooner; the gain falls on deepspeech2, bert and ncf. Two rounds lost on workload-3 and
workload-6 at load 0.5, four gained less on workload-3; the floor on growth into free GPUs only
(not on moves between jobs) lost the gain (``benchmarks/results/sched.md``, session 28).

Payback before the end (``payback_remaining``, default ``True``): the growth floor's horizon is
at most the job's remaining time at its current size, ``T_j = R_j / s_j(r_j^cur)``, so a job
that ends within ``grow_payback`` rounds pays ``g_j = restart_delay / T_j`` of its new speed
to grow (all of it when ``T_j`` is under one restart). Growing from ``s_old`` to ``s_new``
ends the job sooner only if ``T_j (1 - s_old / s_new) > restart_delay``, which is exactly
``s_new (1 - g_j) > s_old``: a job about to finish no longer grows into GPUs freed by a
completion for a gain its restart eats (on workload-3 at load 1.0 a ``yolov3`` job restarted
10 times in its last 31 minutes). Same-run effect, seed 0 over the 16 files: mean 0.875 ->
0.869, better on 13 (by 0.2-2.0%), worse on 3 (workload-6 at loads 1.0-2.0, by 0.3-1.0%);
seed 1: 0.876 -> 0.873, better on 10; on the three files over 0.90 under seeds 0 / 1 / 2,
better on 8 of 9 runs, medians 0.897 / 0.899 / 0.913 (were 0.9005 / 0.908 / 0.917). Over all
48 runs the seed means are 0.8687 / 0.8729 / 0.8691 (were 0.8749 / 0.8756 / 0.8771) and 15 of
the 16 files are <= 0.90 by the median (were 13) (``benchmarks/results/sched.md``, sessions
31 and 32).

Sparse arrivals (``sparse_theta``, default 48 h; ``None`` keeps ``theta`` in every round): while
jobs arrive sparsely, fewer than ``sparse_rate`` (default 0.21) per GPU-hour over the last
``rate_window`` (default 24 h; :class:`~adaptrain.sched._arrivals.ArrivalRate`, from the
creation timestamps of the jobs the policy has seen, once an hour of arrivals is seen), the
weights use ``theta = sparse_theta``: flatter, so long jobs weigh more against short ones. A
fixed 48 h read better than 16 h on workload-6 at load 0.5 over ten seeds (0.8926 against
0.9001) but worse on workload-3 at load 1.0 (0.9246 against 0.9164), and a gate on the jobs
present in the round (48 h with at most one job per 4 GPUs) still lost there (0.9206): the
quiet rounds of a busy trace come before its next burst. The arrival rate tells the two loads
apart where the round's jobs do not: replayed on the artifact's files, the rate reads 6.3-12.5
arrivals per hour on the 64 GPUs at load 0.5 and 14.6 or more at loads 1.0-2.0
(``benchmarks/diag_sched_arrivals.py``), so 0.21 per GPU-hour (13.4 per hour there) opens the
gate in most rounds at load 0.5 and in none above. The threshold is fitted to that gap, a
calibration on this trace's mix of jobs like ``theta`` itself. Effect over ten seeds at load
0.5 (the other loads are unchanged, round for round): workload-1/3/5/6 0.8856/0.9079/0.8882/
0.9001 -> 0.8744/0.9076/0.8788/0.8955 x stored Pollux (``benchmarks/results/sched.md``,
session 47).

The same gate sets two more things while arrivals are sparse: the growth payback
(``sparse_payback``, default 4.5 rounds, in place of ``grow_payback``) and the work prior of a
job never run (``sparse_work``, default ``False``, in place of ``share_work``); ``None`` keeps
the setting of dense arrivals in every round. With few arrivals, GPUs a job grows into stay
with it longer before a newcomer claims them back, so a growth may take longer to repay its
restart (``g`` = 1/9 of the new speed rather than 1/6). A job never run is admitted as any new
job, at weight 1, rather than behind its application's longest job: at light load it competes
mostly for GPUs that would otherwise add little to a long job. Either setting alone leaned the
right way on workload-3 and workload-6 at load 0.5 (by 0.3-0.8 points over ten seeds, with
``grow_payback = 4.5`` level at load 1.0 and ``share_work = False`` 0.5 points worse there),
which is why they follow the gate. Gated, over ten seeds on a host with AVX-512, avg JCT /
stored Pollux at load 0.5: workload-3 0.9064 -> 0.8980 (seeds 10-19: 0.9077 -> 0.8957),
workload-6 0.9047 -> 0.8962 (seeds 10-19: 0.8994 -> 0.8995, level), workload-1 0.8826 ->
0.8848, workload-5 0.8796 -> 0.8843; the twelve files at loads 1.0-2.0 read the same JCTs
(seed 0), the gate shut in every round (``benchmarks/results/sched.md``, session 63).

Shared profiles (``share_profiles``, default ``True``): jobs of one application
(``JobInfo.application``: the same model on the same hardware) have the same throughput, so a
job that has run on fewer replicas than another of its application is valued by the
application's throughput fit (that of its job on the most replicas, by default pooled with its
other largest jobs' fits, below) with its own gradient statistics, and its exploration cap
starts from the application's largest size
(:class:`~adaptrain.sched._profiles.ApplicationProfiles`); a job never run gets the
application's earliest gradient statistics and (``share_work``, default ``True``) the most
work seen left in one of its jobs as its remaining work.
Pollux does not use this label: each of its jobs learns its curve from one GPU up, at most
doubling a round, a restart a step. On workload-3, ten seeds, the jobs restarted about 20% less
(2.49 -> 1.98 restarts per job at load 1.0, seed 0), and the average JCT went from 0.9210 to
0.9152 x stored Pollux at load 1.0 and from 0.9067 to 0.8976 at load 0.5, better under 8 of the
10 seeds at each load; but workload-6 at load 0.5 went from 0.8990 to 0.9005, and under seed 0
the 16 files' mean from 0.8744 to 0.8779 (better on 6; every other file at most 0.894), and
under seed 1 six files of workloads 5 and 6 from 0.864 to 0.874 (``benchmarks/results/sched.md``,
session 60): the default trades typical files, still under 0.90, for the one that misses by
most. ``False`` keeps each job to its own measurements, as in Pollux, and reads better on a
typical file of these traces. ``share_work=False`` (no effect without ``share_profiles``)
leaves a job never run without a remaining-work estimate (weight 1, as any new job) while
sharing the rest. Session 61 measured it over ten seeds: workload-6 at load 0.5 0.9005 ->
0.8933, workload-3 at load 0.5 0.8976 -> 0.9008, workload-3 at load 1.0 0.9152 -> 0.9170, and
under seeds 0 and 1 workloads 5 and 6 at loads 0.5 and 1.0 0.8848 -> 0.8789 (not shared: 0.8745).
Two files stay over the line either way, the one furthest over a little further without the
prior (within the noise), the typical file better: the default was left as it is.

Pooled fits (``pool_fits``, default 16 jobs; ``None`` shares the fit of the application's job
on the most replicas alone): one job's fit can be degenerate where it has measured little. A
cifar10 job that jumped to 63 GPUs from one node had a single multi-node measurement, and its
fit put one network cost on every multi-node size; shared, it valued every later cifar10 job
20-25% low on 8-32 GPUs (workload-1 at load 0.5, seed 1: 0.932, against 0.875-0.893 under the
file's other nine seeds). The shared parameters are instead refitted to the fits of the
application's ``pool_fits`` jobs that have run on the most replicas, each read only at the
(nodes, replicas) configurations the policy has placed it on
(:class:`~adaptrain.sched._profiles.ApplicationProfiles`). Ten seeds on a host with AVX-512,
avg JCT / stored Pollux: workload-3 at load 1.0 0.9136 -> 0.9021 (better under all ten seeds;
over twenty seeds 0.9158 -> 0.9065; pools of 8 and 32 jobs read about 0.908),
workload-1 at load 0.5 0.8874 -> 0.8826, workload-3 at load 0.5 0.9055 -> 0.9064, workload-6
at load 0.5 0.9002 -> 0.9047; the 16 files over seeds 0-4: mean 0.8740 -> 0.8706, better on
12. Read at powers of two up to each job's largest size instead (sizes a ramp of 4 -> 16 -> 64
never ran on), the pool carried the fits' extrapolations and lost on the typical file
(``benchmarks/results/sched.md``, session 62). A refit (``fit_perf_params``, about 0.06 s) runs
when a pooled job first runs on a multi-GPU configuration: the policy's time per round stays
under 0.03 s on average on these traces.

Genetic patience (``genetic_patience``, default ``None``): stop a round's genetic refinement
after that many generations in a row without a fitter candidate. Replayed on 297 recorded
rounds of the heaviest file, the best candidate improved after the first generation in under
10% of the rounds, so a patience of 10 would skip 76% of the generations; but the generations
that find nothing better still evolve the population that warm-starts the next round. Seed 0,
workload-1/3/5/6 at load 2.0 and workload-1/3/5 at load 1.5: a patience of 10 cut the heaviest
file's policy time by about 65% (0.035 s per round) but lost 0.8 points of avg JCT on average
(better on one file, worse on five); 25 lost 0.5 points on the load-2.0 files. An option for
clusters where the policy's time matters more than the last point of JCT
(``benchmarks/results/sched.md``, session 32).

Node floor (``min_nodes``, default 2: off): a job placed on more than one node spans at least
``min_nodes`` nodes (at most the cluster's). The goodput model prices a multi-node job by its
replica count alone, whatever the number of nodes, so a policy packs it on as few nodes as hold
it; on the Pollux artifact's cluster, 5-8 replicas on two nodes run 20-70% slower than on
three or four, for every one of its six models (``placements.csv``: yolov3 at 8 replicas 39
samples/s on 2 nodes, 61 on 3, 63-68 on 4, 64 on one node of 4). With ``min_nodes=3`` the local
search spreads such a job over the emptiest nodes free of other multi-node jobs, as evenly as
their free GPUs allow, where there are enough of them (else it packs as before), and the genetic
refinement values a placement on 2 .. ``min_nodes - 1`` nodes at nothing. Same-host readings,
avg JCT / stored Pollux (``benchmarks/results/sched.md``, session 64): workload-3 at load 1.0
0.9081 -> 0.9064 over twenty seeds (better under 12), workload-3 at load 0.5 0.8998 -> 0.8970
and workload-6 at load 0.5 0.8964 -> 0.8950 over ten, each within about one standard error;
over seeds 0-2 other files move by up to two points either way (workload-6 at load 1.0 -2.0,
workload-5 at load 1.0 +1.1). An option, not the default: no gain on the target file, and the
rule fits that cluster's measurements; where GPUs within a node talk faster than across nodes
(NVLink), packing is the better rule.

Calibration (``calibrate``, default ``True``): the goodput model's throughput part prices an
all-reduce by two regimes, within a node or across nodes, and by the replica count; it cannot
tell two nodes from four, and a fit to measurements from both is wrong at both. Each round the
policy pools the step times the jobs of an application have measured
(``JobInfo.profile``: ``(nodes, replicas, atomic_bsz) -> (step_time, sync_time)``, the latest
16 jobs to report a change) and scales the throughput of each job's model, at every
``(nodes, replicas)`` measured, by the measured over the modelled samples per second there
(geometric means over batch sizes and jobs); configurations nobody has run on keep the model
(:class:`~adaptrain.sched._calibration.ThroughputCalibration`). The remaining-work estimate
follows the calibrated one-GPU goodput. Why: replayed with the simulator's true step times in
place of the models (a scratch oracle), workload-3 at load 1.0 read 0.883 / 0.873 / 0.885 x
stored Pollux under seeds 0-2 against the default's 0.915 / 0.904 / 0.910, nearly all of it
from multi-node configurations (true one-node times alone: 0.912 on seed 0; true two-node times
alone 0.902). Calibrating where measured recovers most of that, on an Intel host with
``AVX512_SPR``: workload-3 at load 1.0 0.9081 -> **0.8971** over twenty seeds (better under 18),
workload-3 / workload-6 at load 0.5 0.8998 / 0.8964 -> 0.8898 / 0.8919 over ten; over seeds
0-2 the 16 files' mean 0.8704 -> 0.8643, better on 12, four at loads 1.5-2.0 worse by 0.5-1.3
points (all at most 0.868); at about 1.2x the policy's time per round
(``benchmarks/results/sched.md``, session 65). Extending a node count's mean factor to its
unmeasured replica counts read worse (0.909 on seed 0, a scratch run). Jobs without an
``application`` or a profile are valued by their models as before; ``False`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping

import numpy as np

from ._arrivals import DEFAULT_MIN_SPAN, ArrivalRate
from ._calibration import ThroughputCalibration
from ._plan import WeightedGeneticSearch, check_min_nodes
from ._profiles import ApplicationProfiles
from .policy_base import Allocation, JobInfo, NodeInfo
from .speedup import ExploringSpeedup, LinearSpeedup, PowerSpeedup, RampSpeedup

logger = logging.getLogger(__name__)

__all__ = ["WaterfillPolicy"]


def _unmeasured(job: JobInfo) -> bool:
    """A job that has never run and has no goodput model (no speedup, or the linear guess)."""
    return job.max_profiled_replicas == 0 and (
        job.speedup_fn is None or isinstance(job.speedup_fn, LinearSpeedup)
    )


def _fair_shares(caps: Mapping[str, int], total: int) -> dict[str, float]:
    """Max-min fair shares of ``total`` GPUs, job ``k`` taking at most ``caps[k]``: equal
    shares, a job capped below its share giving the rest to the others (water-filling)."""
    out: dict[str, float] = {}
    left, order = float(total), sorted(caps, key=lambda k: caps[k])
    for i, k in enumerate(order):
        even = left / (len(order) - i)
        if caps[k] > even:  # this job and every larger one get an even share
            return {**out, **{j: even for j in order[i:]}}
        out[k] = float(caps[k])
        left -= caps[k]
    return out


def _best_fit(r: int, free: Mapping[int, int]) -> int | None:
    """The fullest node with at least ``r`` free GPUs (ties: lowest key), or ``None``."""
    fits = [n for n in free if free[n] >= r]
    return min(fits, key=lambda n: (free[n], n)) if fits else None


class WaterfillPolicy:
    """Remaining-work-weighted goodput maximisation: warm-started local search, refined by a
    genetic search (``search="genetic"``, default) or not (``search="local"``)."""

    name = "waterfill"

    def __init__(
        self,
        theta: float = 16 * 3600.0,
        alpha: float = 1.0,
        weighting: str = "srpt",
        p: float = 1.0,
        restart_delay: float = 30.0,
        gpus_per_node: int = 4,
        min_restart_cost: float = 0.0,
        search: str = "genetic",
        pop_size: int = 50,
        generations: int = 50,
        seed: int | None = 0,
        genetic_runs: int = 1,
        explore_beta: float | None = 0.5,
        explore_horizon: float = 3600.0,
        explore_observed: bool = True,
        ramp_credit: float | None = 1.0,
        ramp_doublings: int = 3,
        round_seconds: float = 60.0,
        explore_growth: float | None = 4.0,
        first_replicas: int | None = 4,
        first_beta: float = 0.5,
        future_gamma: float | None = 0.5,
        grow_payback: float | None = 3.0,
        payback_remaining: bool = True,
        genetic_patience: int | None = None,
        sparse_theta: float | None = 48 * 3600.0,
        sparse_rate: float = 0.21,
        rate_window: float = 24 * 3600.0,
        share_profiles: bool = True,
        share_work: bool = True,
        pool_fits: int | None = 16,
        sparse_payback: float | None = 4.5,
        sparse_work: bool | None = False,
        min_nodes: int = 2,
        calibrate: bool = True,
    ) -> None:
        if first_replicas is not None and first_replicas < 1:
            raise ValueError(
                f"first_replicas={first_replicas} must be >= 1, or None (the allocator's 1 GPU)"
            )
        if future_gamma is not None and not future_gamma >= 0.0:
            raise ValueError(
                f"future_gamma={future_gamma} must be >= 0, or None (weights not divided by a "
                "job's later speed)"
            )
        if grow_payback is not None and not grow_payback > 0.0:
            raise ValueError(
                f"grow_payback={grow_payback} must be > 0 rounds, or None (growth priced by the "
                "restart penalty alone)"
            )
        if not 0.0 <= first_beta <= 1.0:
            raise ValueError(f"first_beta={first_beta} must lie in [0, 1]")
        check_min_nodes(min_nodes)
        if explore_growth is not None and not explore_growth >= 1.0:
            raise ValueError(
                f"explore_growth={explore_growth} must be >= 1, or None (the allocator's cap)"
            )
        if explore_beta is not None and not 0.0 <= explore_beta <= 1.0:
            raise ValueError(
                f"explore_beta={explore_beta} must lie in [0, 1], or be None (no exploration)"
            )
        if ramp_credit is not None and not ramp_credit >= 0.0:
            raise ValueError(f"ramp_credit={ramp_credit} must be >= 0, or None (no ramp credit)")
        if ramp_doublings < 1:
            raise ValueError(f"ramp_doublings={ramp_doublings} must be >= 1")
        if not round_seconds > 0:
            raise ValueError(f"round_seconds={round_seconds} must be > 0 (the scheduling interval)")
        if explore_horizon < 0:
            raise ValueError(f"explore_horizon={explore_horizon} must be >= 0 seconds")
        if theta <= 0 or alpha < 0:
            raise ValueError(f"theta={theta} must be > 0 and alpha={alpha} >= 0")
        if sparse_theta is not None and not sparse_theta > 0:
            raise ValueError(
                f"sparse_theta={sparse_theta} must be > 0 seconds, or None (theta whatever the "
                "arrival rate)"
            )
        if sparse_payback is not None and not sparse_payback > 0.0:
            raise ValueError(
                f"sparse_payback={sparse_payback} must be > 0 rounds, or None (grow_payback "
                "whatever the arrival rate)"
            )
        if not (math.isfinite(sparse_rate) and sparse_rate >= 0):
            raise ValueError(f"sparse_rate={sparse_rate} must be >= 0 arrivals per GPU-hour")
        # ArrivalRate checks this too; here the message names the policy's own parameter
        if not (math.isfinite(rate_window) and rate_window >= DEFAULT_MIN_SPAN):
            raise ValueError(
                f"rate_window={rate_window} must be a finite number of seconds >= "
                f"{DEFAULT_MIN_SPAN:g} (the arrival rate needs an hour of arrivals)"
            )
        if weighting not in ("las", "srpt"):
            raise ValueError(f"weighting={weighting!r} must be 'las' or 'srpt'")
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={gpus_per_node} must be >= 1")
        if search not in ("genetic", "local"):
            raise ValueError(f"search={search!r} must be 'genetic' or 'local'")
        if genetic_runs < 1:
            raise ValueError(f"genetic_runs={genetic_runs} must be >= 1")
        if genetic_patience is not None and genetic_patience < 1:
            raise ValueError(
                f"genetic_patience={genetic_patience} must be >= 1 generation, or None (every "
                "generation runs)"
            )
        self.theta = theta
        self.alpha = alpha
        self.sparse_theta = sparse_theta
        self.sparse_rate = sparse_rate
        self.sparse_payback = sparse_payback
        self.sparse_work = sparse_work
        #: whether the latest round saw sparse arrivals (below ``sparse_rate``); the round's
        #: ``theta_now`` and ``payback_now`` follow from it
        self.sparse_now = False
        self.rate_window = rate_window
        self._arrivals = ArrivalRate(window=rate_window)
        self.weighting = weighting
        self.p = p
        self.restart_delay = restart_delay
        self.min_restart_cost = min_restart_cost
        self.gpus_per_node = gpus_per_node
        self.search = search
        self.explore_beta = explore_beta
        self.explore_horizon = explore_horizon
        self.explore_observed = explore_observed
        self.ramp_credit = ramp_credit
        self.ramp_doublings = ramp_doublings
        self.round_seconds = round_seconds
        self.explore_growth = explore_growth
        self.first_replicas = first_replicas
        self.first_beta = first_beta
        self.future_gamma = future_gamma
        self.grow_payback = grow_payback
        self.payback_remaining = payback_remaining
        self.share_profiles = share_profiles
        self.share_work = share_work
        self.pool_fits = pool_fits
        self._profiles = (
            ApplicationProfiles(work_prior=share_work, pool=pool_fits) if share_profiles else None
        )
        self.min_nodes = min_nodes
        self.calibrate = calibrate
        self._calibration = ThroughputCalibration() if calibrate else None
        self._runs: list[WeightedGeneticSearch] = []
        if search == "genetic":
            self._runs = [
                WeightedGeneticSearch(
                    pop_size,
                    generations,
                    restart_delay,
                    None if seed is None else seed + i,
                    grow_cost=self._grow_cost(),
                    patience=genetic_patience,
                    min_nodes=self.min_nodes,
                )
                for i in range(genetic_runs)
            ]

    def _grow_cost(self) -> float:
        """The least share of its new speed a running job that grows pays for its restart:
        ``restart_delay / (grow_payback * round_seconds)``, at most 1 (0 without
        ``grow_payback``)."""
        if self.payback_now is None or self.restart_delay <= 0:
            return 0.0
        return min(1.0, self.restart_delay / (self.payback_now * self.round_seconds))

    def _grow_costs(
        self, jobs: Mapping[str, JobInfo], base_allocations: Mapping[str, list[int]]
    ) -> dict[str, float]:
        """Per running job, the least share of its new speed it pays to grow when its
        remaining time at its current size, ``T = remaining_work / s(current)``, is shorter
        than the payback horizon: ``restart_delay / T`` (at most 1; see "Payback before the
        end" in the module docstring). Jobs not listed pay :meth:`_grow_cost`."""
        d = self.restart_delay
        if not self.payback_remaining or d <= 0:
            return {}
        horizon = math.inf if self.payback_now is None else self.payback_now * self.round_seconds
        out = {}
        for k, job in jobs.items():
            r = len(base_allocations.get(k, []))
            rem, fn = job.remaining_work, job.speedup_fn
            if not r or rem is None or fn is None:
                continue
            s = max(float(fn(-(-r // self.gpus_per_node), r)), 1e-9)
            t_rem = rem / s
            if t_rem < horizon:
                out[k] = min(1.0, d / max(t_rem, 1e-9))
        return out

    def state_dict(self) -> dict:
        """The genetic searches' warm-start populations and generator states (none if local):
        one run's state dict's keys, or ``"runs": [...]`` with ``genetic_runs > 1``; and
        ``"arrivals"``, the jobs seen for the arrival rate (with ``sparse_theta``,
        ``sparse_payback`` or ``sparse_work``); and ``"profiles"``, the applications' shared
        throughput fits (with ``share_profiles``); and ``"calibration"``, the applications'
        measured step times (with ``calibrate``)."""
        out: dict = {}
        if len(self._runs) == 1:
            out.update(self._runs[0].state_dict())
        elif self._runs:
            out["runs"] = [g.state_dict() for g in self._runs]
        if self._gated():
            out["arrivals"] = self._arrivals.state_dict()
        if self._profiles is not None:
            out["profiles"] = self._profiles.state_dict()
        if self._calibration is not None:
            out["calibration"] = self._calibration.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        arrivals = state.pop("arrivals", None)
        if arrivals is not None:
            self._arrivals.load_state_dict(arrivals)
        profiles = state.pop("profiles", None)
        if profiles is not None and self._profiles is not None:
            self._profiles.load_state_dict(profiles)
        calibration = state.pop("calibration", None)
        if calibration is not None and self._calibration is not None:
            self._calibration.load_state_dict(calibration)
        if not self._runs or not state:
            return
        runs = state["runs"] if "runs" in state else [state]
        if len(runs) != len(self._runs):
            raise ValueError(
                f"state holds {len(runs)} genetic runs, this policy has genetic_runs="
                f"{len(self._runs)}: construct it with the same genetic_runs"
            )
        for g, st in zip(self._runs, runs, strict=True):
            g.load_state_dict(st)

    def _gated(self) -> bool:
        """Whether any setting depends on the arrival rate (``sparse_theta``,
        ``sparse_payback`` or ``sparse_work``)."""
        return (
            self.sparse_theta is not None
            or self.sparse_payback is not None
            or self.sparse_work is not None
        )

    def sparse_arrivals(self, jobs: Mapping[str, JobInfo], gpus: int, now: float) -> bool:
        """Whether the arrival rate seen over the last ``rate_window`` is below
        ``sparse_rate`` per GPU-hour (``False`` before an hour of arrivals is seen, and when
        no setting depends on it). Notes the jobs' creation timestamps."""
        if not self._gated():
            return False
        for k, job in jobs.items():
            self._arrivals.observe(k, job.creation_timestamp)
        rate = self._arrivals.rate(now, gpus)
        return rate is not None and rate < self.sparse_rate

    @property
    def theta_now(self) -> float:
        """The latest round's ``theta``: ``sparse_theta`` while arrivals were sparse (see
        "Sparse arrivals" in the module docstring), else ``theta``."""
        if self.sparse_now and self.sparse_theta is not None:
            return self.sparse_theta
        return self.theta

    @property
    def payback_now(self) -> float | None:
        """The latest round's growth payback: ``sparse_payback`` while arrivals were sparse,
        else ``grow_payback``."""
        if self.sparse_now and self.sparse_payback is not None:
            return self.sparse_payback
        return self.grow_payback

    def replica_bound(self, job: JobInfo) -> int:
        """The most replicas this policy gives ``job`` now: up to ``first_replicas`` for a job
        never run and unmodelled, else up to ``explore_growth`` times the largest size it has
        run on (with ``share_profiles``, the most any job of its application has run on);
        within its ``replica_limit``, and never below the allocator's ``max_replicas`` (see the
        module docstring)."""
        if self._profiles is not None:
            job = self._profiles.bound_view(job)
        limit = job.replica_limit
        if limit is None or job.max_replicas >= limit:
            return job.max_replicas
        if self.first_replicas is not None and _unmeasured(job):
            grown = self.first_replicas
        elif self.explore_growth is not None:
            grown = math.floor(self.explore_growth * job.max_profiled_replicas)
        else:
            return job.max_replicas
        return max(job.max_replicas, min(limit, grown))

    def allocate_job(self, job: JobInfo, nodes: Mapping[int, NodeInfo]) -> list[int]:
        """A place for one job that arrives between rounds, on free GPUs only
        (``nodes[n].gpus`` free on node ``n``): up to :meth:`replica_bound` replicas on one
        node, the fullest node that holds them all (best fit) or else the one with the most
        free GPUs (ties: lowest key); ``[]`` if no node has ``max(min_replicas, 1)`` free.

        Nobody else moves, so nothing is restarted; the next round re-plans the job with all
        the others. A new job thus starts as it arrives instead of at the next round (half a
        round sooner on average), as under AdaptDL's allocator."""
        want = self.replica_bound(job)
        need = max(job.min_replicas, 1)
        free = {n: int(info.gpus) for n, info in nodes.items() if int(info.gpus) >= need}
        if not free:
            return []
        node = _best_fit(want, free)
        if node is None:
            node = min(free, key=lambda n: (-free[n], n))
        return [node] * min(want, free[node])

    def _widen(self, jobs: Mapping[str, JobInfo]) -> Mapping[str, JobInfo]:
        """The jobs with ``max_replicas`` set to :meth:`replica_bound`, and a job that has never
        run valued at ``r ** first_beta`` (see the module docstring)."""
        out = dict(jobs)
        for k, job in jobs.items():
            changes = {}
            bound = self.replica_bound(job)
            if bound != job.max_replicas:
                changes["max_replicas"] = bound
            if self.first_replicas is not None and _unmeasured(job):
                changes["speedup_fn"] = PowerSpeedup(self.first_beta)
            if changes:
                out[k] = dataclasses.replace(job, **changes)
        return out

    def _explore(self, jobs: Mapping[str, JobInfo]) -> Mapping[str, JobInfo]:
        """Jobs whose speedup beyond their largest tried size is made optimistic (see the
        module docstring); the others unchanged."""
        if self.explore_beta is None:
            return jobs
        out = dict(jobs)
        for k, job in jobs.items():
            r0, fn = job.max_profiled_replicas, job.speedup_fn
            if fn is None or job.remaining_work is None or not 1 <= r0 < job.max_replicas:
                continue
            fn = ExploringSpeedup(
                fn, r0, self.explore_beta, self.gpus_per_node, observed=self.explore_observed
            )
            if job.remaining_work > self.explore_horizon * max(fn.s0, 1e-9):
                out[k] = dataclasses.replace(job, speedup_fn=fn)
        return out

    def _ramp(self, jobs, keys, weight, curves, current, total, rel_cost, need, grow):
        """Jobs held by their exploration cap, with the step to the cap credited by the ramp
        it unlocks (see the module docstring): ``{key: JobInfo}``, the others left out."""
        g = self.gpus_per_node
        tops = {}
        for k in keys:
            job = jobs[k]
            r0, cap, limit = job.max_profiled_replicas, job.max_replicas, job.replica_limit
            if job.speedup_fn is not None and limit is not None and 1 <= r0 < cap < limit:
                top = min(r0 * 2**self.ramp_doublings, limit, total)
                if top > cap:
                    tops[k] = top
        if not tops:
            return {}
        # where the ramps would end: the plan with the caps lifted, every job competing
        lifted = dict(curves)
        for k, top in tops.items():
            lifted[k] = self._utility(self._curve(jobs[k], top))
        plan = self._local_search(keys, weight, lifted, current, total, rel_cost, need, grow)
        out: dict[str, JobInfo] = {}
        d = self.restart_delay
        for k in tops:
            job = jobs[k]
            cap, far = job.max_replicas, plan[k]
            if far <= cap:
                continue
            fn = job.speedup_fn
            gain = float(fn(-(-far // g), far)) - float(fn(-(-cap // g), cap))
            # one round's gain, a one-off, as a rate over the job's restart horizon (as the
            # restart penalty converts its one-off loss): round * (restarts + 1) / (age + d)
            rate = min(1.0, self.round_seconds * (job.num_restarts + 1) / max(job.age + d, 1e-9))
            bonus = self.ramp_credit * rate * gain
            if bonus > 0:
                speedup = RampSpeedup(fn, job.max_profiled_replicas, cap, bonus)
                out[k] = dataclasses.replace(job, speedup_fn=speedup)
        return out

    def _curve(self, job: JobInfo, rmax: int) -> np.ndarray:
        """s(r) for r = 0..rmax on packed placements (``r`` if the job has no model yet)."""
        r = np.arange(1, rmax + 1)
        n = np.ceil(r / self.gpus_per_node).astype(np.int64)
        fn = job.speedup_fn
        s = r.astype(np.float64) if fn is None else np.asarray(fn(n, r), dtype=np.float64)
        return np.concatenate([[0.0], np.maximum(s, 0.0)])

    def _weights(
        self,
        jobs: Mapping[str, JobInfo],
        keys: list[str],
        speedups: Mapping[str, np.ndarray] | None = None,
        total: int | None = None,
    ) -> dict[str, float]:
        """Remaining-work (or attained-service) weights, divided by ``s_future ** future_gamma``
        when ``speedups`` (``{key: s(0..rmax)}``, from :meth:`_curve`) and ``total`` are given
        (see the module docstring)."""
        theta = self.theta_now
        if self.weighting == "las":
            out = {k: (1.0 + jobs[k].attained_service / theta) ** (-self.alpha) for k in keys}
        else:
            out = {}
            for k in keys:  # unknown remaining work (new job): the largest weight, as under LAS
                rem = jobs[k].remaining_work
                out[k] = 1.0 if rem is None else (1.0 + rem / theta) ** (-self.alpha)
        if not self.future_gamma or speedups is None or total is None:
            return out
        # each job capped at its goodput peak within its bound (none if it may have no GPU)
        peak = {k: int(np.argmax(speedups[k][1:])) + 1 if len(speedups[k]) > 1 else 0 for k in keys}
        share = _fair_shares(peak, total)
        for k in keys:
            job = jobs[k]
            if job.speedup_fn is None or job.remaining_work is None or not peak[k]:
                continue  # no model or a new job: its speed to come is unknown
            r = min(max(1, int(share[k])), len(speedups[k]) - 1)
            out[k] *= max(1.0, float(speedups[k][r])) ** (-self.future_gamma)
        return out

    def _utility(self, s: np.ndarray) -> np.ndarray:
        """``s`` (p = 1), ``s**p / p`` or ``log s`` (p = 0). Only differences between sizes
        r >= 1 matter: every job gets its first GPU before the search moves GPUs."""
        if self.p == 1.0:
            return s
        out = np.zeros_like(s)
        pos = s > 0
        out[pos] = np.log(s[pos]) if self.p == 0.0 else s[pos] ** self.p / self.p
        return out

    def optimize(
        self,
        jobs: Mapping[str, JobInfo],
        nodes: Mapping[int, NodeInfo],
        base_allocations: Mapping[str, list[int]],
        time: float,
    ) -> Allocation:
        """One round: replica counts by local search, then placement."""
        total = sum(int(n.gpus) for n in nodes.values())
        if not jobs or total == 0:
            return {}
        # this round's theta_now and payback_now follow; the work prior (None: the instance's)
        self.sparse_now = self.sparse_arrivals(jobs, total, time)
        prior = self.sparse_work if self.sparse_now else None
        if self._profiles is not None:  # throughput fits shared within applications
            self._profiles.observe(jobs, base_allocations)
            jobs = {k: self._profiles.share(job, prior) for k, job in jobs.items()}
        if self._calibration is not None:  # models corrected where measured
            self._calibration.observe(jobs)
            jobs = {k: self._calibration.calibrate(job) for k, job in jobs.items()}
        grow = self._grow_costs(jobs, base_allocations)
        jobs = self._explore(self._widen(jobs))
        keys = sorted(jobs, key=lambda k: (jobs[k].attained_service, jobs[k].creation_timestamp))
        raw = {k: self._curve(jobs[k], min(jobs[k].max_replicas, total)) for k in keys}
        weight = self._weights(jobs, keys, raw, total)
        curves = {k: self._utility(raw[k]) for k in keys}
        d = self.restart_delay
        rel_cost = {
            k: min(
                1.0,
                max(
                    self.min_restart_cost,
                    # d = 0: restarts are free (also for a job of age 0)
                    d * (jobs[k].num_restarts + 1) / (jobs[k].age + d) if d > 0 else 0.0,
                ),
            )
            for k in keys
        }
        current = {k: min(len(base_allocations.get(k, [])), len(curves[k]) - 1) for k in keys}
        need = {k: max(1, jobs[k].min_replicas) for k in keys}
        # non-preemptible running jobs keep their allocation: the search sizes the others on
        # the GPUs left, placement puts them first (the genetic refinement pins them too)
        pinned = {}
        for k in keys:
            alloc = [n for n in base_allocations.get(k, []) if n in nodes]
            if not jobs[k].preemptible and alloc:
                pinned[k] = alloc
        movable = [k for k in keys if k not in pinned]
        left = total - sum(len(a) for a in pinned.values())
        if self.ramp_credit is not None:  # credit the steps to the caps (in both searches)
            ramped = self._ramp(jobs, movable, weight, curves, current, left, rel_cost, need, grow)
            jobs = {**jobs, **ramped}
            for k in ramped:
                curves[k] = self._utility(self._curve(jobs[k], len(curves[k]) - 1))
        target = self._local_search(movable, weight, curves, current, left, rel_cost, need, grow)
        for k in movable:  # honour minimum replicas: below it a job gets nothing
            if target[k] < jobs[k].min_replicas:
                target[k] = 0
        target.update({k: len(a) for k, a in pinned.items()})
        placed = self._place(keys, target, nodes, base_allocations, need, pinned)
        if not self._runs:
            return placed
        # independent searches (own seeds and warm-start populations): keep the fittest answer;
        # beyond max_jobs_full jobs proportionally fewer of them (a bound on the cost per round)
        full = self._runs[0].max_jobs_full
        n_runs = max(1, min(len(self._runs), len(self._runs) * full // len(jobs)))
        best, best_fit = placed, -np.inf
        for g in self._runs[:n_runs]:
            g.grow_cost = self._grow_cost()  # this round's payback
            out = g.refine(jobs, nodes, base_allocations, weight, placed, grow)
            if g.last_fitness > best_fit:
                best, best_fit = out, g.last_fitness
        return best

    def _local_search(
        self, keys, weight, curves, current, total, rel_cost, need, grow=None
    ) -> dict[str, int]:
        """Start from the current sizes; admit waiting jobs, fill free GPUs, then move GPUs
        between jobs while the weighted utility gain beats the loss plus restart costs.
        ``grow`` (``{key: cost}``, from :meth:`_grow_costs`) overrides the growth floor."""
        g = self.gpus_per_node
        target = {k: current[k] for k in keys}
        free = total - sum(target.values())
        penalty = {k: weight[k] * abs(curves[k][current[k]]) * rel_cost[k] for k in keys}
        grow_cost = self._grow_cost()
        grow = grow or {}

        def value(k: str, r: int) -> float:
            v = weight[k] * curves[k][r]
            if current[k] and r != current[k]:
                cost = penalty[k]
                if r > current[k]:  # a growth repays its restart within grow_payback rounds
                    cost = max(cost, weight[k] * abs(curves[k][r]) * grow.get(k, grow_cost))
                v -= cost
            return v

        def best_grow(k: str) -> tuple[float, int]:
            r, rmax = target[k], len(curves[k]) - 1
            best, best_d = 0.0, 0
            for d in range(1, min(rmax - r, 2 * g) + 1):
                gain = (value(k, r + d) - value(k, r)) / d
                if gain > best + 1e-12:
                    best, best_d = gain, d
            return best, best_d

        def shrink_loss(k: str) -> float:
            r = target[k]
            if r <= need[k]:
                return np.inf
            return value(k, r) - value(k, r - 1)

        # 1. admit waiting jobs (one GPU each), taking GPUs from the cheapest donors if needed
        waiting = sorted(
            (k for k in keys if target[k] == 0 and len(curves[k]) > 1), key=lambda k: -weight[k]
        )
        for k in waiting:
            n = need[k]
            if n > len(curves[k]) - 1:
                continue
            if free >= n:
                target[k], free = n, free - n
                continue
            donor = min(keys, key=shrink_loss)
            if n == 1 and shrink_loss(donor) < value(k, 1) - value(k, 0):
                target[donor] -= 1
                target[k] = 1
        # 2. fill free GPUs greedily, 3. then move GPUs while it pays
        for _ in range(4 * total):
            gains = {k: best_grow(k) for k in keys if target[k] > 0}
            if not gains:
                break
            k_up = max(gains, key=lambda k: gains[k][0])
            gain, d = gains[k_up]
            if gain <= 0:
                break
            if free > 0:
                d = min(d, free)
                target[k_up] += d
                free -= d
                continue
            # no free GPU: take d GPUs from the donor losing least (not the receiver)
            donors = [k for k in keys if k != k_up and target[k] - d >= need[k]]
            if not donors:
                break
            loss = {k: (value(k, target[k]) - value(k, target[k] - d)) / d for k in donors}
            k_down = min(loss, key=loss.get)
            if gain <= loss[k_down] + 1e-9:
                break
            target[k_down] -= d
            target[k_up] += d
        return target

    def _place(self, keys, target, nodes, base_allocations, need, pinned=None) -> Allocation:
        """Nodes for the chosen sizes; a job that does not fit gets the largest size that
        does, but never less than its minimum (then nothing). ``pinned`` jobs (``{key: nodes}``,
        non-preemptible) keep their nodes, placed first."""
        g = self.gpus_per_node
        cap = {n: int(info.gpus) for n, info in nodes.items()}
        free = dict(cap)
        multi_owner: dict[int, bool] = {n: False for n in nodes}
        out: Allocation = {}
        for k, alloc in (pinned or {}).items():
            counts = {n: alloc.count(n) for n in set(alloc)}
            for n, c in counts.items():
                free[n] -= c
                if len(counts) > 1:
                    multi_owner[n] = True
            out[k] = list(alloc)
        for k in keys:  # keep placements whose size is unchanged
            if k in out:
                continue
            alloc = list(base_allocations.get(k, []))
            if alloc and len(alloc) == target[k] and all(n in free for n in alloc):
                counts = {n: alloc.count(n) for n in set(alloc)}
                if all(free[n] >= c for n, c in counts.items()):
                    multi = len(counts) > 1
                    if multi and any(multi_owner[n] for n in counts):
                        continue
                    for n, c in counts.items():
                        free[n] -= c
                        if multi:
                            multi_owner[n] = True
                    out[k] = alloc
        pending = [k for k in keys if target[k] > 0 and k not in out]
        pending.sort(key=lambda k: -target[k])
        for k in pending:
            r, alloc = target[k], None
            while r >= need[k]:
                alloc = self._fit(r, free, multi_owner, g, self.min_nodes)
                if alloc is not None:
                    break
                r -= 1
            if alloc is None:
                continue
            counts = {n: alloc.count(n) for n in set(alloc)}
            for n, c in counts.items():
                free[n] -= c
                if len(counts) > 1:
                    multi_owner[n] = True
            out[k] = alloc
        return out

    @staticmethod
    def _fit(r: int, free: dict, multi_owner: dict, g: int, min_nodes: int = 2) -> list[int] | None:
        """Nodes for ``r`` replicas (``free`` GPUs per node, changed by the caller): one node,
        the fullest that holds them all; else nodes without another multi-node job, emptiest
        first, on at least ``min_nodes`` of them (at most the cluster's) where enough such
        nodes have free GPUs, split as evenly as their free GPUs allow, else packed on as few
        as hold them; ``None`` if they do not fit, or only on over one node more than packed."""
        if r <= g:
            n = _best_fit(r, free)
            if n is not None:
                return [n] * r
        # multi-node: nodes without another multi-node job, emptiest first
        cand = sorted(
            (n for n in free if free[n] > 0 and not multi_owner[n]), key=lambda n: (-free[n], n)
        )
        if sum(free[n] for n in cand) < r:
            return None
        packed, spread = math.ceil(r / g), min(min_nodes, len(free))
        if min_nodes > 2 and packed < spread and r >= spread and len(cand) >= spread:
            # the `spread` emptiest nodes, least free first: each takes its even share of
            # what is left, or all it has, and the emptier ones make up the rest
            chosen = sorted(cand[:spread], key=lambda n: (free[n], n))
            alloc, left = [], r
            for i, n in enumerate(chosen):
                take = min(free[n], math.ceil(left / (spread - i)))
                alloc.extend([n] * take)
                left -= take
            if left == 0:
                return sorted(alloc)
        alloc: list[int] = []
        for n in cand:
            take = min(free[n], r - len(alloc))
            alloc.extend([n] * take)
            if len(alloc) == r:
                break
        if len(set(alloc)) > packed + 1:
            return None  # too fragmented; try a smaller size
        return sorted(alloc)
