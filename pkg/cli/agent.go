package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodeaddr"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
	"k8s.io/client-go/rest"
)

// agentFlags are the flags of the agent itself: the policy flags, the datapath's (with each
// backend's own) and the observability flags.
type agentFlags struct {
	policyFlags
	sourceFlags
	statusFlags
	backendFlags
	backend        string
	interfaces     string
	metricsAddress string
	metricsSecure  bool
	metricsCert    string
	metricsKey     string
	verbosity      int
	driftInterval  time.Duration
	ruleMetrics    int
	generation     int64 // --template-generation
}

func (f *agentFlags) register(fs *flagSet) {
	f.policyFlags.register(fs)
	fs.group("configuration", func() { f.sourceFlags.register(fs.FlagSet) })
	fs.group("datapath", func() {
		fs.StringVar(&f.backend, "backend", backends.Auto, backends.Usage())
		fs.StringVar(&f.interfaces, "interfaces", "", "comma-separated uplinks to masquerade on, or devices written !name to leave out of the default: the devices of the default routes and of every route, in any table, toward a masqueraded destination")
		fs.DurationVar(&f.driftInterval, "drift-check-interval", agent.DefaultDriftInterval, "how often to check that the installed datapath is intact and repair it when not; 0 leaves the repair to the resync")
		fs.Func("template-generation", "the template generation of the agent's DaemonSet pod (its pod-template-generation label, through the downward API): an agent of a later generation takes the node over from the holder of the node lock at once, as a rollout with maxSurge needs; 0 or empty (unknown) waits for the holder to exit",
			func(s string) error { return parseGeneration(s, &f.generation) })
	})
	f.backendFlags.register(fs)
	fs.group("observability", func() {
		fs.StringVar(&f.metricsAddress, "metrics-address", ":9743", "HOST:PORT serving /metrics, /healthz and /readyz; empty disables")
		fs.BoolVar(&f.metricsSecure, "metrics-secure", false, "serve HTTPS, and /metrics only to clients the API server vouches for: a bearer token that passes a TokenReview, of a user allowed to get the non-resource URL /metrics (SubjectAccessReview); /healthz and /readyz stay open. Needs the API server (--kubeconfig)")
		fs.StringVar(&f.metricsCert, "metrics-cert-file", "", "PEM certificate of --metrics-secure, read at start; empty means a self-signed one made at start, in memory")
		fs.StringVar(&f.metricsKey, "metrics-key-file", "", "PEM private key of --metrics-cert-file")
		f.statusFlags.register(fs.FlagSet)
		fs.IntVar(&f.ruleMetrics, "rule-metrics-limit", metrics.DefaultRuleSeries, "how many rules have series of their own in the per-rule metrics: a policy of more rules exports the busiest (every rule counts in the per-origin totals, and dump shows them all); 0 exports every rule, two series each")
		// Accepted so that upstream manifests keep working: klog verbosity (4 and above log debug).
		fs.IntVar(&f.verbosity, "v", 0, "log verbosity; 4 or more logs debug messages")
		fs.Bool("logtostderr", true, "ignored: logs always go to stderr (accepted for upstream manifests)")
	})
}

// parseAgentFlags parses the arguments of the command named name, which takes the agent's flags
// (so that the DaemonSet's arguments can be reused) and its own, which own registers, and no
// positional argument; the backends' flags are checked. Its help lists its own flags and the
// agent's it reads (reads), and names the others as accepted.
func parseAgentFlags(name string, args []string, stderr io.Writer, reads []string, own func(fs *flagSet)) (*agentFlags, error) {
	var af agentFlags
	fs := newFlagSet(commandNamed(name), stderr)
	fs.group(name, func() { own(fs) })
	af.register(fs)
	fs.listOnly(append(fs.groups[0].names, reads...))
	if err := parseNoArgs(fs.FlagSet, args); err != nil {
		return nil, err
	}
	return &af, af.backendFlags.check()
}

func (f *agentFlags) interfaceList() []string {
	var out []string
	for _, s := range strings.Split(f.interfaces, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

func runAgent(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet(agentCommand, stderr)
	af.register(fs)
	pos, err := parseInterspersed(fs.FlagSet, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{fmt.Errorf("the agent takes no arguments; subcommands: %s", commandNames())}
	}
	copts, popts, err := af.options()
	if err != nil {
		return err
	}
	bo, err := af.agentBackendOptions()
	if err != nil {
		return err
	}
	log := newLogger(stderr, af.verbosity)
	bo.Logger = log
	log.Info("starting", "component", "cli", "version", version.String(), "config", af.configPath, "configSource", af.source, "backend", af.backend)
	// The first deferred call is the last made: it stands by once all is released.
	var handOver handOver
	defer handOver.standBy(log)
	dp, err := backends.Choose(ctx, af.backend, bo)
	if err != nil {
		return err
	}
	defer func() {
		if err := dp.Close(); err != nil {
			log.Warn("release the datapath", "component", "cli", "error", err)
		}
	}()
	// Choosing the backend installed nothing; from here on this process may change the
	// datapath, so it first becomes the node's only agent.
	lock, err := acquireNodeLock(ctx, af.generation, log)
	if err != nil && ctx.Err() != nil {
		log.Info("stopped while waiting for the node lock; nothing was changed", "component", "cli")
		return nil
	}
	if err != nil {
		return err
	}
	defer lock.Release()
	ctx = handOver.watch(ctx, lock, log)
	src, err := af.open(af.configPath, copts, af.nodeName, log)
	if err != nil {
		return err
	}
	addrs, stopWatch, err := watchNodeAddresses(ctx, af.interfaceList(), log)
	if err != nil {
		return err
	}
	defer stopWatch()
	return af.serve(ctx, dp, src, popts, addrs, lock, log)
}

// watchNodeAddresses follows the node's addresses (nodeaddr) until stop is called.
func watchNodeAddresses(ctx context.Context, interfaces []string, log *slog.Logger) (addrs *nodeaddr.Checker, stop func(), err error) {
	if addrs, err = nodeaddr.New(interfaces, log); err != nil {
		return nil, nil, err
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		addrs.Watch(watchCtx)
	}()
	return addrs, func() {
		stopWatch()
		<-watched
		addrs.Close()
	}, nil
}

// serve runs the agent over the chosen datapath until ctx ends: its loop, the status it
// publishes, its endpoint with the metrics, and the configuration it applied (on the lock).
func (af *agentFlags) serve(ctx context.Context, dp *backends.Chosen, src config.Source, popts policy.Options, addrs *nodeaddr.Checker, lock *nodelock.Lock, log *slog.Logger) error {
	obs := metrics.NewObserver()
	opts := agent.Options{Source: src, PolicyOptions: popts, Backend: dp.Backend, Logger: log,
		Observer: obs, Changes: dp.Changes, Displace: dp.Displace, DriftInterval: af.driftInterval, Addresses: addrs}
	// A nil *podsource.Watcher must not become a non-nil agent.PodSource.
	if pods, why := af.pods(af.nodeName, log); pods != nil {
		opts.Pods = pods
	} else {
		opts.NoPods = why
	}
	a, err := agent.New(opts)
	if err != nil {
		return err
	}
	answerConfig(lock, a, af.sourceName(), af.policyFlags)
	pub, err := af.publisher(a, dp, src, log)
	if err != nil {
		return err
	}
	mo := metrics.Options{Backend: dp.Backend, Entries: backends.All, Agent: a, Observer: obs, Logger: log,
		Fallback: dp.CannotRun, RuleSeries: af.ruleSeries(), Source: src}
	if pub != nil {
		mo.Status = pub
	}
	ln, err := af.serveMetrics(ctx, a, mo, log)
	if err != nil {
		return err
	}
	pubCtx, stopPub := context.WithCancel(ctx)
	defer runPublisher(pubCtx, pub)()
	defer stopPub()
	return a.Run(ctx, ln)
}

// acquireNodeLock makes this process the node's agent: it takes the node lock, waiting as long
// as another agent (or a cleanup) holds it, so that two agents never program one node at once.
// An agent of an older pod template generation is asked to hand the node over (handover.go);
// any other holder is waited for: an operator's agent beside the DaemonSet's thus takes over
// within nodelock.PollInterval of the holder's exit, where refusing would leave a crash-looping
// pod that takes over only after its backoff. A waiting agent serves nothing: its health
// endpoints would take the holder's address.
func acquireNodeLock(ctx context.Context, generation int64, log *slog.Logger) (*nodelock.Lock, error) {
	log = log.With("component", "cli", "lock", "@"+nodelock.Name)
	me := nodelock.Me("agent", version.Version)
	me.Generation = generation
	lock, err := nodelock.Acquire(ctx, nodelock.Name, me, func(w nodelock.Wait) {
		switch {
		case w.HandingOver:
			log.Info("the node lock's holder hands the node over to this newer agent; waiting for it to let go", "holder", w.Holder.String(), "generation", generation)
		case w.Refused != "":
			log.Warn("another agent holds the node lock and does not hand the node over; waiting to take over when it exits", "holder", w.Holder.String(), "reason", w.Refused)
		default:
			log.Warn("another process holds the node lock; waiting to take over when it exits", "holder", w.Holder.String())
		}
	})
	if err != nil {
		return nil, err
	}
	log.Info("node lock acquired: this agent programs the node's datapath")
	return lock, nil
}

// agentBackendOptions checks the flags only the agent uses (the datapath's and the loop's) and
// returns the backends' options (without a logger).
func (f *agentFlags) agentBackendOptions() (backends.Options, error) {
	if err := backends.CheckName(f.backend); err != nil {
		return backends.Options{}, usageError{err}
	}
	if _, _, err := f.object(); err != nil {
		return backends.Options{}, err
	}
	if err := f.statusFlags.check(); err != nil {
		return backends.Options{}, err
	}
	if !f.metricsSecure && f.metricsCert+f.metricsKey != "" {
		return backends.Options{}, usageError{errors.New("metrics-cert-file and metrics-key-file need --metrics-secure")}
	}
	if (f.metricsCert == "") != (f.metricsKey == "") {
		return backends.Options{}, usageError{errors.New("metrics-cert-file and metrics-key-file go together")}
	}
	if f.ruleMetrics < 0 {
		return backends.Options{}, usageError{fmt.Errorf("rule-metrics-limit %d: must be 0 (every rule) or more", f.ruleMetrics)}
	}
	if f.driftInterval < 0 {
		return backends.Options{}, usageError{fmt.Errorf("drift-check-interval %v: must be positive, or 0 to turn the checks off", f.driftInterval)}
	}
	o := f.backendOptions(nil)
	if err := o.Check(); err != nil {
		return backends.Options{}, usageError{err}
	}
	return o, nil
}

// ruleSeries is metrics.Options.RuleSeries for --rule-metrics-limit.
func (f *agentFlags) ruleSeries() int {
	if f.ruleMetrics == 0 {
		return -1 // every rule
	}
	return f.ruleMetrics
}

// serveMetrics adds /metrics to the agent's endpoint, with the applies obs records, and listens
// on --metrics-address (none when empty): with --metrics-secure, over TLS, /metrics served only
// to the clients the API server authenticates and authorizes. Listening before the loop starts
// makes a taken port an immediate, clear error.
func (af *agentFlags) serveMetrics(ctx context.Context, a *agent.Agent, opts metrics.Options, log *slog.Logger) (net.Listener, error) {
	reg, err := metrics.NewRegistry(opts)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	h := metrics.Handler(reg, opts.Logger)
	if af.metricsAddress == "" {
		a.Mux().Handle("GET "+metrics.Path, h)
		return nil, nil
	}
	h, ln, err := listenMetrics(ctx, af.metricsAddress, af.metricsSecure, af.metricsCert, af.metricsKey, h,
		func() (*rest.Config, error) { return af.restConfig(log) }, log)
	if err != nil {
		return nil, err
	}
	a.Mux().Handle("GET "+metrics.Path, h)
	return ln, nil
}

// backendOptions are what the backends take from the flags.
func (f *agentFlags) backendOptions(log *slog.Logger) backends.Options {
	return backends.Options{Interfaces: f.interfaceList(), Logger: log, Settings: f.own}
}

// newLogger logs text to stderr; --v 4 or more adds debug messages, as klog's verbosity did.
func newLogger(stderr io.Writer, verbosity int) *slog.Logger {
	level := slog.LevelInfo
	if verbosity >= 4 {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
}
