"""Pipeline schedules: the table every part reads (`schedules`) and the simulation of torch's own action order
that gives each schedule's bound and the planner's pipeline step time (`simulate`)."""
