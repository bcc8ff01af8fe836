package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
)

// takeoverLimit is how soon after the holder's exit a waiting agent must hold the node lock.
var takeoverLimit = Scaled(time.Second)

// lockHolder asks the node lock, inside the node namespace, who holds it (the zero Holder when
// nobody does).
func lockHolder(t *testing.T, env *Env) nodelock.Holder {
	t.Helper()
	var h nodelock.Holder
	if err := testutil.Do(env.Node, func() error { h = nodelock.Describe(nodelock.Name); return nil }); err != nil {
		t.Fatal(err)
	}
	return h
}

// waitHolder waits until agent a holds the node lock and returns how long that took.
func waitHolder(ctx context.Context, t *testing.T, env *Env, a *Agent) time.Duration {
	t.Helper()
	start := time.Now()
	if err := testutil.PollContext(ctx, 5*time.Millisecond, func() error {
		if h := lockHolder(t, env); h.Pid != a.Pid() {
			if exited, err := a.Exited(); exited {
				return fmt.Errorf("exited (%v) before it held the node lock:\n%s", err, a.Logs())
			}
			return testutil.NotYet("the node lock held by %s", h)
		}
		return nil
	}); err != nil {
		t.Fatalf("agent %d: %v", a.Pid(), err)
	}
	return time.Since(start)
}

// assertWaiting checks that agent a waits for the node lock and has programmed nothing.
func assertWaiting(ctx context.Context, t *testing.T, a *Agent, holder *Agent) {
	t.Helper()
	if err := a.WaitLog(ctx, 1, "another process holds the node lock", fmt.Sprintf("pid %d", holder.Pid())); err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{"node lock acquired", "policy applied", "datapath loaded", "attached"} {
		if n := a.Count(line); n != 0 {
			t.Errorf("the waiting agent logged %q %d times: it programmed the datapath", line, n)
		}
	}
}

// TestTwoAgents: two agents started together on one node. Exactly one holds the node lock and
// programs the datapath while the other waits; when the holder exits, by SIGTERM and then by
// SIGKILL, the waiting agent takes over within a second. Traffic stays masqueraded throughout:
// a held TCP connection and a held UDP flow keep their mappings and a new connection every
// round is masqueraded (the external host has no route back to the pod). An agent stopped
// while it waits exits at once.
func TestTwoAgents(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.SetGood("", true)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})

		// Both at once (same flags, same metrics address): one binds the lock first.
		a1, a2 := env.StartAgent(ctx, t, b), env.StartAgent(ctx, t, b)
		var holder, waiter *Agent
		if err := testutil.PollContext(ctx, 5*time.Millisecond, func() error {
			switch h := lockHolder(t, env); h.Pid {
			case a1.Pid():
				holder, waiter = a1, a2
			case a2.Pid():
				holder, waiter = a2, a1
			default:
				return testutil.NotYet("neither agent took the node lock (held by %s)", h)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if err := holder.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		assertWaiting(ctx, t, waiter, holder)
		b.Verify(ctx, t, env)

		env.CutReturnRoutes(ctx, t)
		conns, seen := heldFlows(ctx, t, env, public4)
		w := watchFlows(ctx, env, conns, seen)
		time.Sleep(300 * time.Millisecond)
		assertWaiting(ctx, t, waiter, holder)

		// The holder stops as in a rollout; the waiting agent takes over.
		if err := holder.Stop(ctx); err != nil {
			t.Fatalf("holder exit after SIGTERM: %v", err)
		}
		took := waitHolder(ctx, t, env, waiter)
		t.Logf("after SIGTERM: the waiting agent held the lock %v after the holder's exit", took)
		if took > takeoverLimit {
			t.Errorf("the takeover after SIGTERM took %v, more than %v", took, takeoverLimit)
		}
		if err := waiter.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}

		// A third waits behind the new holder, which is killed: the kernel frees the lock.
		third := env.StartAgent(ctx, t, b)
		assertWaiting(ctx, t, third, waiter)
		// A fourth, stopped while it waits, exits at once and changes nothing.
		fourth := env.StartAgent(ctx, t, b)
		assertWaiting(ctx, t, fourth, waiter)
		if err := fourth.Stop(ctx); err != nil {
			t.Errorf("an agent stopped while waiting: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
		if err := waiter.Kill(ctx); err != nil {
			t.Fatal(err)
		}
		took = waitHolder(ctx, t, env, third)
		t.Logf("after SIGKILL: the waiting agent held the lock %v after the holder's death", took)
		if took > takeoverLimit {
			t.Errorf("the takeover after SIGKILL took %v, more than %v", took, takeoverLimit)
		}
		if err := third.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		w.stop(t, 20)
		b.Verify(ctx, t, env)
	})
}

// TestHandOver: a rollout with maxSurge on one node. The old pod's agent (template generation
// 1) holds the node; the new pod's (generation 2), started beside it with the same flags and
// metrics address, asks it to hand the node over. The old agent stops as on SIGTERM (the
// datapath stays), frees the metrics port and the lock and stands by; the new one takes the
// lock within a second and answers /readyz at the same address. The old pod's container
// started again by the kubelet (generation 1 again) waits behind the newer agent and takes
// nothing back; the standing-by agent exits at once on SIGTERM. A held TCP connection, a held
// UDP flow and a new connection every round stay masqueraded throughout.
func TestHandOver(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.SetGood("", true)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		flags := env.AgentFlags
		startGeneration := func(gen int) *Agent {
			env.AgentFlags = append(slices.Clip(flags), fmt.Sprintf("--template-generation=%d", gen))
			return env.StartAgent(ctx, t, b)
		}
		old := startGeneration(1)
		if err := old.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if err := old.WaitLog(ctx, 1, "policy applied"); err != nil {
			t.Fatal(err)
		}
		env.CutReturnRoutes(ctx, t)
		conns, seen := heldFlows(ctx, t, env, public4)
		w := watchFlows(ctx, env, conns, seen)
		time.Sleep(300 * time.Millisecond)

		start := time.Now()
		newer := startGeneration(2)
		// A liveness bound, not a speed one: without the handover the old agent, which never
		// exits on its own, would keep the lock for good.
		hctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		waitHolder(hctx, t, env, newer)
		cancel()
		t.Logf("the newer agent held the node lock %v after its start", time.Since(start))
		if err := newer.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		for _, line := range []string{"the node lock's holder hands the node over to this newer agent", "node lock acquired"} {
			if err := newer.WaitLog(ctx, 1, line); err != nil {
				t.Error(err)
			}
		}
		to := fmt.Sprintf("pid %d", newer.Pid())
		for _, line := range [][]string{{"a newer agent takes the node over", to}, {"shutting down; the datapath stays in place"},
			{"handed the node over; standing by until stopped", to}} {
			if err := old.WaitLog(ctx, 1, line...); err != nil {
				t.Error(err)
			}
		}
		if exited, err := old.Exited(); exited {
			t.Fatalf("the old agent exited (%v) after the handover: its pod would be restarted", err)
		}
		// The DaemonSet's startup probe: the holder is the agent of the asker's pid namespace
		// (here the test's, every agent's), not of another one (another container's).
		if out, err := NSExec(ctx, env.Node, "", env.Bin, "holder", "--mine"); err != nil || !strings.Contains(string(out), fmt.Sprintf("agent (pid %d,", newer.Pid())) {
			t.Errorf("holder --mine beside the holder: %v: %s", err, out)
		}
		if out, err := NSExec(ctx, env.Node, "", "unshare", "--pid", "--fork", env.Bin, "holder", "--mine"); err == nil || !strings.Contains(err.Error(), "this container's agent does not hold it") {
			t.Errorf("holder --mine from another pid namespace: %v: %s, want it refused", err, out)
		}

		// The old pod's container, started again: it waits and takes nothing back.
		restarted := startGeneration(1)
		assertWaiting(ctx, t, restarted, newer)
		time.Sleep(300 * time.Millisecond)
		if h := lockHolder(t, env); h.Pid != newer.Pid() {
			t.Errorf("the node lock is held by %s, want the newer agent", h)
		}
		if err := old.Stop(ctx); err != nil {
			t.Errorf("the old agent, standing by, on SIGTERM: %v", err)
		}
		if err := restarted.Stop(ctx); err != nil {
			t.Errorf("the restarted old agent, waiting, on SIGTERM: %v", err)
		}
		time.Sleep(300 * time.Millisecond)
		w.stop(t, 20)
		b.Verify(ctx, t, env)
	})
}

// TestCleanupBesideAgent: `cleanup` refuses to run while an agent holds the node lock, naming
// the agent and leaving its datapath alone; with --force it removes everything anyway.
func TestCleanupBesideAgent(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		// No drift checks: the agent must not put back what the forced cleanup removes
		// before the test has looked.
		env.AgentFlags = append(env.AgentFlags, "--drift-check-interval=0")
		ag := env.StartReady(ctx, t, b, "")

		out, err := NSExec(ctx, env.Node, "", env.Bin, env.DatapathArgs("cleanup", b)...)
		want := fmt.Sprintf("cleanup refused: the node lock is held by ip-masq-agent agent (pid %d,", ag.Pid())
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "pass --force") {
			t.Fatalf("cleanup beside the agent: %v (%s), want it refused with %q", err, out, want)
		}
		b.Verify(ctx, t, env)
		env.Check(ctx, t, expect(Masq, "8.8.8.8"), nil)

		args := append([]string{"netns", "exec", env.Node, env.Bin}, append(env.DatapathArgs("cleanup", b), "--force")...)
		out, err = exec.CommandContext(ctx, "ip", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("cleanup --force: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "cleaning up under a running agent (--force)") {
			t.Errorf("cleanup --force did not warn that an agent runs:\n%s", out)
		}
		b.Gone(ctx, t, env)
		if exited, err := ag.Exited(); exited {
			t.Errorf("the agent exited (%v)", err)
		}
	})
}
