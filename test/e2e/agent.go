package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// MetricsAddress is where the agent under test serves /healthz and /readyz, on the node
// namespace's own loopback.
const MetricsAddress = "127.0.0.1:9808"

// Process is a command running inside a network namespace (ip netns exec), its output
// collected.
type Process = testutil.Process

// StartProcess runs name with args inside ns, bound to the test: killed with its process group
// when the test ends, its output logged if the test failed.
func StartProcess(ctx context.Context, t testing.TB, ns, name string, args ...string) *Process {
	t.Helper()
	return testutil.StartCmd(t, netnsCommand(ctx, ns, name, args...))
}

// Spawn runs name with args inside ns, bound to no test: the caller ends it (Stop, Kill,
// KillGroup). The kernel kills it if this process dies first.
func Spawn(ctx context.Context, ns, name string, args ...string) (*Process, error) {
	return testutil.Spawn(netnsCommand(ctx, ns, name, args...))
}

// netnsCommand runs name with args inside ns (ip netns exec, which execs the command in place).
// The process outlives the call, so it gets a context of its own rather than one that a caller
// might cancel early.
func netnsCommand(ctx context.Context, ns, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(context.WithoutCancel(ctx), "ip", append([]string{"netns", "exec", ns, name}, args...)...)
}

// Agent is the agent binary running inside the node namespace.
type Agent struct {
	*Process
	ns string
}

// AgentArgs are the arguments the harness runs the agent with: args, after --metrics-address
// (MetricsAddress) and debug logging.
func AgentArgs(args ...string) []string {
	return append([]string{"--metrics-address=" + MetricsAddress, "--v=4"}, args...)
}

// StartAgent runs bin inside ns with AgentArgs(args), as a Process bound to the test.
func StartAgent(ctx context.Context, t testing.TB, ns, bin string, args ...string) *Agent {
	t.Helper()
	return &Agent{Process: StartProcess(ctx, t, ns, bin, AgentArgs(args...)...), ns: ns}
}

// SpawnAgent runs bin inside ns with AgentArgs(args), as a Process bound to no test.
func SpawnAgent(ctx context.Context, ns, bin string, args ...string) (*Agent, error) {
	p, err := Spawn(ctx, ns, bin, AgentArgs(args...)...)
	if err != nil {
		return nil, err
	}
	return &Agent{Process: p, ns: ns}, nil
}

// RSS is the agent's resident memory (VmRSS), in bytes.
func (a *Agent) RSS() (int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", a.Pid()))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("VmRSS %q: %w", v, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, errors.New("no VmRSS in /proc/PID/status")
}

// CPUTime is the CPU time (user and system) the agent used so far.
func (a *Agent) CPUTime() (time.Duration, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", a.Pid()))
	if err != nil {
		return 0, err
	}
	// The fields after the command name, which is in parentheses and may hold spaces.
	_, rest, ok := strings.Cut(string(data), ") ")
	f := strings.Fields(rest)
	if !ok || len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", a.Pid(), data)
	}
	var ticks int64
	for _, v := range f[11:13] { // utime, stime
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", a.Pid(), err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / 100, nil // USER_HZ is 100 on Linux
}

// Count is how many log lines contain every one of subs.
func (a *Agent) Count(subs ...string) int {
	n := 0
next:
	for _, l := range strings.Split(a.Logs(), "\n") {
		for _, s := range subs {
			if !strings.Contains(l, s) {
				continue next
			}
		}
		n++
	}
	return n
}

// LogTime is the time (slog's time= attribute) of the n-th log line (from 1) that contains
// every one of subs.
func (a *Agent) LogTime(n int, subs ...string) (time.Time, error) {
	seen := 0
next:
	for _, l := range strings.Split(a.Logs(), "\n") {
		for _, s := range subs {
			if !strings.Contains(l, s) {
				continue next
			}
		}
		if seen++; seen < n {
			continue
		}
		v, _, _ := strings.Cut(strings.TrimPrefix(l, "time="), " ")
		return time.Parse(time.RFC3339Nano, v)
	}
	return time.Time{}, fmt.Errorf("no log line %d with %q", n, subs)
}

// WaitLog waits until at least n log lines contain every one of subs.
func (a *Agent) WaitLog(ctx context.Context, n int, subs ...string) error {
	return a.poll(ctx, fmt.Sprintf("%d log lines with %q", n, subs), func() (bool, error) {
		return a.Count(subs...) >= n, nil
	})
}

// Get fetches a path of the agent's HTTP endpoint from inside the node namespace.
func (a *Agent) Get(ctx context.Context, path string) (int, string, error) {
	return HTTPGet(ctx, a.ns, "http://"+MetricsAddress+path)
}

// httpTimeout bounds one request: a liveness bound, so that a poll asks again after a request
// that hangs. A scrape reads every counter of the datapath, which in a TCG guest beside other
// guests took over 2 s (the iptables backend's counters on 5.10).
var httpTimeout = Scaled(10 * time.Second)

// HTTPGet fetches url from inside the namespace ns.
func HTTPGet(ctx context.Context, ns, url string) (int, string, error) {
	client := http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		// The socket must be made inside the namespace; the transport dials from goroutines of
		// its own, so the dial itself is moved there.
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var c net.Conn
			err := testutil.Do(ns, func() error {
				var err error
				c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}}
	ctx, cancel := context.WithTimeout(ctx, httpTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// WaitReady waits until /readyz answers 200.
func (a *Agent) WaitReady(ctx context.Context) error {
	return a.poll(ctx, "/readyz 200", func() (bool, error) {
		code, _, err := a.Get(ctx, "/readyz")
		return err == nil && code == http.StatusOK, nil
	})
}

// WaitServing waits until the HTTP endpoint answers at all, and returns /readyz's answer.
func (a *Agent) WaitServing(ctx context.Context) (int, string, error) {
	var code int
	var body string
	err := a.poll(ctx, "/readyz answering", func() (bool, error) {
		var err error
		code, body, err = a.Get(ctx, "/readyz")
		return err == nil, nil
	})
	return code, body, err
}

// poll checks cond every 5 ms until it holds, the agent exits, or ctx ends.
func (a *Agent) poll(ctx context.Context, what string, cond func() (bool, error)) error {
	if err := testutil.PollContext(ctx, 5*time.Millisecond, func() error {
		if ok, err := cond(); ok || err != nil {
			return err
		}
		if exited, err := a.Exited(); exited {
			return fmt.Errorf("the agent exited (%v); its log ends:\n%s", err, testutil.LastLines(a.Logs(), 20))
		}
		return testutil.NotYet("%s", what)
	}); err != nil {
		return fmt.Errorf("waiting for %s: %w", what, err)
	}
	return nil
}

// ConfigDir is a config directory that is updated the way the kubelet updates a ConfigMap
// volume (testutil.Projection): by default one key, ip-masq-agent, whose file the agent is
// given; with several keys (WriteFiles) the directory itself.
type ConfigDir struct {
	*testutil.Projection
}

// NewConfigDir returns an empty config directory (no file: the agent's defaults).
func NewConfigDir(t testing.TB) *ConfigDir { return &ConfigDir{testutil.NewProjection(t.TempDir())} }

// Path is the config file path to give the agent.
func (c *ConfigDir) Path() string { return c.Projection.Path("ip-masq-agent") }

// Write publishes a new version of the file.
func (c *ConfigDir) Write(content string) error {
	return c.Projection.Write(map[string]string{"ip-masq-agent": content})
}

// WriteFiles publishes a new version of the directory with these files (name to content).
func (c *ConfigDir) WriteFiles(files map[string]string) error { return c.Projection.Write(files) }
