package container

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// root is the repository, from this package's directory.
const root = "../.."

// The image every test of the package runs, built once (make build, then image.Build, then
// podman load into a store of the package's own), and that store.
var (
	buildOnce sync.Once
	built     *builtImage
	buildErr  error
	workDir   string
	podman    *Podman
)

type builtImage struct {
	Ref     string
	Result  image.Result
	Options image.Options
	// Binary is the agent in the image, as make build made it.
	Binary string
	Took   time.Duration
}

// hostNetns is the test binary's network namespace when it starts: the host's.
var hostNetns uint64

func TestMain(m *testing.M) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/net", &st); err != nil {
		fmt.Fprintln(os.Stderr, "container:", err)
		os.Exit(1)
	}
	hostNetns = st.Ino
	code := m.Run()
	if podman != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		if err := podman.Reset(ctx); err != nil {
			fmt.Fprintln(os.Stderr, "container:", err)
			code = 1
		}
		cancel()
	}
	if workDir != "" {
		os.RemoveAll(workDir)
	}
	os.Exit(code)
}

// theImage returns the image, building it the first time. Tests that need it need root, the
// build tools and podman: under CI=true their absence fails the test.
func theImage(t *testing.T) *builtImage {
	t.Helper()
	testutil.RequirePrivileged(t, "make", "git", "mmdebstrap", "podman", "runc", "ip", "iptables-nft-save", "iptables-legacy-save", "nft")
	buildOnce.Do(func() { built, buildErr = build() })
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

func build() (*builtImage, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var err error
	if workDir, err = os.MkdirTemp("", "ip-masq-agent-container-"); err != nil {
		return nil, err
	}
	start := time.Now()
	bin := filepath.Join(workDir, "ip-masq-agent")
	if out, err := command(ctx, "make", "-s", "build", "BIN="+bin); err != nil {
		return nil, fmt.Errorf("make build: %w\n%s", err, out)
	}
	version, err := os.ReadFile(filepath.Join(root, "VERSION"))
	if err != nil {
		return nil, err
	}
	// As make image does: the last commit's time.
	ct, err := command(ctx, "git", "log", "-1", "--format=%ct")
	if err != nil {
		return nil, fmt.Errorf("git log: %w", err)
	}
	secs, err := strconv.ParseInt(strings.TrimSpace(ct), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("commit time %q: %w", ct, err)
	}
	v := strings.TrimSpace(string(version))
	opts := image.Options{Spec: image.Runtime, Binary: bin, Version: v, Reference: image.Repository + ":" + v,
		Epoch: time.Unix(secs, 0), Output: filepath.Join(workDir, "image.tar")}
	res, err := image.Build(ctx, opts)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(workDir, "podman")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	if podman, err = NewPodman(dir); err != nil {
		return nil, err
	}
	if _, err := podman.Run(ctx, "load", "--quiet", "--input", opts.Output); err != nil {
		return nil, err
	}
	return &builtImage{Ref: opts.Reference, Result: res, Options: opts, Binary: bin, Took: time.Since(start)}, nil
}

// command runs a tool in the repository's root and returns its combined output.
func command(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// The image podman loaded is what the build wrote and what the Dockerfile describes: its ID is
// the configuration's digest, it starts the agent as root, and the agent is the release.
func TestImage(t *testing.T) {
	img := theImage(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id, err := podman.Inspect(ctx, img.Ref, "{{.Id}} {{.Digest}} {{json .Config.Entrypoint}} {{.Config.User}} {{.Size}}")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(id)
	if want := []string{img.Result.Config.Encoded(), img.Result.Manifest.String(), `["` + image.Runtime.Binary + `"]`, image.Runtime.User}; !equal(f[:4], want) {
		t.Errorf("loaded image: %q, want %q", f[:4], want)
	}
	t.Logf("image %s: id %s, manifest %s, %s bytes; make build + image build + load took %v", img.Ref, f[0][:12], f[1], f[4], img.Took.Round(time.Second))
	out, err := podman.Run(ctx, "run", "--rm", "--pull=never", "--network=none", img.Ref, "version")
	if err != nil {
		t.Fatal(err)
	}
	head, err := command(ctx, "git", "rev-parse", "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	if want := "ip-masq-agent " + img.Options.Version + " (commit " + strings.TrimSpace(head); !strings.HasPrefix(out, want) {
		t.Errorf("version in the image: %q, want it to start with %q", out, want)
	}
	for _, pkg := range image.Runtime.Packages {
		if _, err := podman.Run(ctx, "run", "--rm", "--pull=never", "--network=none", "--entrypoint", "dpkg-query", img.Ref, "-W", pkg); err != nil {
			t.Errorf("package %s: %v", pkg, err)
		}
	}
}

func equal(a, b []string) bool { return strings.Join(a, "\x00") == strings.Join(b, "\x00") }

// Two builds from the same binary, sources and SOURCE_DATE_EPOCH are the same archive, byte
// for byte, so the same manifest digest and image ID.
func TestImageIsReproducible(t *testing.T) {
	img := theImage(t)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	again := img.Options
	again.Output = filepath.Join(t.TempDir(), "again.tar")
	start := time.Now()
	res, err := image.Build(ctx, again)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("second build: %v, manifest %s", time.Since(start).Round(time.Second), res.Manifest)
	if res != img.Result {
		t.Errorf("second build %+v, first %+v", res, img.Result)
	}
	if a, b := fileSum(t, img.Options.Output), fileSum(t, again.Output); a != b {
		t.Errorf("archives differ: %s and %s", a, b)
	}
}

func fileSum(t *testing.T, name string) string {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%x", h.Sum(nil))
}

// readManifest decodes one manifest of deploy/ strictly.
func readManifest(t *testing.T, name string, into any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "deploy", name))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(data, into); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

// The DaemonSet's container in podman, in a node namespace of an e2e topology: under a
// RuntimeDefault that allows bpf(2) with CAP_BPF (containerd's and Docker's do; here the
// shipped profile, which is podman's with that) the agent picks BPF; under podman's own it
// falls back, and says that seccomp is why, to iptables, or to nftables where kube-proxy runs in
// nftables mode; --backend=nftables runs nft from the image under the shipped profile. Each
// time it becomes ready, masquerades the pod's traffic, serves metrics, leaves the datapath in
// place on SIGTERM, and the cleanup DaemonSet's container from the same image removes
// everything.
func TestDaemonSet(t *testing.T) {
	img := theImage(t)
	t.Parallel() // beside the second build of TestImageIsReproducible
	shipped, err := filepath.Abs(filepath.Join(root, "deploy", "seccomp", "ip-masq-agent.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		// seccomp and cleanupSeccomp are the agent's and the cleanup's profiles, "" for
		// podman's default.
		seccomp, cleanupSeccomp string
		backend                 e2e.Backend
		run                     daemonSetRun
	}{
		{"runtime-default-with-bpf", shipped, shipped, e2e.BPFBackend(tc.ModeTCX), daemonSetRun{}},
		{"podman-default", "", "", e2e.IptablesBackend(iptables.ModeNFT), daemonSetRun{}},
		// A cleanup that cannot call bpf(2) removes the links' pins, which detaches them, and
		// says so rather than "0 program attachments removed".
		{"cleanup-without-bpf", shipped, "", e2e.BPFBackend(tc.ModeTCX), daemonSetRun{}},
		// The backend's Prepare gives the node kube-proxy's nftables table.
		{"podman-default-kube-proxy-nftables", "", "", e2e.NftablesBackend(), daemonSetRun{prepare: true}},
		{"nftables-flag", shipped, shipped, e2e.NftablesBackend(), daemonSetRun{backendFlag: "--backend=nftables"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			runDaemonSet(t, img, tt.seccomp, tt.cleanupSeccomp, tt.backend, tt.run)
		})
	}
}

// daemonSetRun is what a run changes of the node and the manifest.
type daemonSetRun struct {
	// prepare runs the backend's Prepare on the node before the agent starts.
	prepare bool
	// backendFlag, when set, replaces the DaemonSet's --backend=auto.
	backendFlag string
}

func runDaemonSet(t *testing.T, img *builtImage, seccomp, cleanupSeccomp string, backend e2e.Backend, run daemonSetRun) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ds, cleanupDS appsv1.DaemonSet
	var cm corev1.ConfigMap
	readManifest(t, "base/daemonset.yaml", &ds)
	readManifest(t, "base/configmap.yaml", &cm)
	readManifest(t, "cleanup/daemonset.yaml", &cleanupDS)
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]
	if c.Image != img.Ref {
		t.Fatalf("the DaemonSet runs %s, the build is %s", c.Image, img.Ref)
	}
	if run.backendFlag != "" {
		i := slices.Index(c.Args, "--backend=auto")
		if i < 0 {
			t.Fatalf("the DaemonSet's arguments %q have no --backend=auto to replace", c.Args)
		}
		c.Args = slices.Clone(c.Args)
		c.Args[i] = run.backendFlag
	}
	if p := Profile(spec, c); p == nil || p.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Fatalf("the DaemonSet's seccomp profile is %+v: this test runs RuntimeDefault", p)
	}

	tp := e2e.NewTopology(ctx, t)
	bpffs := testutil.MountBPFFS(t)
	dir := t.TempDir()
	src := Sources{
		HostPaths:  map[string]string{"/sys/fs/bpf": bpffs, "/run/xtables.lock": filepath.Join(dir, "xtables.lock")},
		ConfigMaps: map[string]string{cm.Name: filepath.Join(dir, "config")},
	}
	for _, v := range spec.Volumes {
		if v.ConfigMap != nil {
			if err := os.Mkdir(src.ConfigMaps[v.ConfigMap.Name], 0o755); err != nil {
				t.Fatal(err)
			}
			if err := ProjectConfigMap(src.ConfigMaps[v.ConfigMap.Name], &cm, v.ConfigMap); err != nil {
				t.Fatal(err)
			}
		}
	}
	env := &e2e.Env{Topology: tp, Bin: img.Binary, AgentFlags: []string{"--bpffs=" + bpffs}, Good: cm.Data["config"]}
	if run.prepare {
		backend.Prepare(ctx, t, env)
	}

	name := "agent-" + tp.Node
	// The DaemonSet controller's labels of a first rollout's pod.
	labels := maps.Clone(ds.Spec.Template.Labels)
	labels["pod-template-generation"] = "1"
	args, err := PodmanArgs(spec, c, Run{Name: name, Image: img.Ref, NetNS: tp.Node, Seccomp: seccomp, Sources: src, Labels: labels})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := podman.Run(ctx, args...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if t.Failed() {
			logs, _ := podman.Logs(ctx, name)
			t.Logf("podman %s\nagent log:\n%s", strings.Join(args, " "), logs)
		}
		if _, err := podman.Run(ctx, "rm", "--force", "--time=0", name); err != nil {
			t.Error(err)
		}
	})
	// The container's process exists from init on, stopped before the agent runs: its network
	// namespace must be the node's before anything happens in it.
	if _, err := podman.Run(ctx, "init", name); err != nil {
		t.Fatal(err)
	}
	pid, err := podman.Inspect(ctx, name, "{{.State.Pid}}")
	if err != nil {
		t.Fatal(err)
	}
	checkNetns(t, pid, tp.Node)
	if _, err := podman.Run(ctx, "start", name); err != nil {
		t.Fatal(err)
	}

	// Ready and live, as the kubelet's probes see it.
	readyURL, err := ProbeURL(c, c.ReadinessProbe)
	if err != nil {
		t.Fatal(err)
	}
	liveURL, err := ProbeURL(c, c.LivenessProbe)
	if err != nil {
		t.Fatal(err)
	}
	waitReady(ctx, t, name, tp.Node, readyURL)
	ready := time.Since(start)
	// The startup probe, run in the container as the kubelet runs it: the lock's holder is the
	// agent of the container's pid namespace, of the pod's template generation.
	if p := c.StartupProbe; p == nil || p.Exec == nil {
		t.Errorf("no exec startup probe: %+v", p)
	} else if out, err := podman.Run(ctx, append([]string{"exec", name}, p.Exec.Command...)...); err != nil || !strings.Contains(out, "ip-masq-agent agent (pid 1,") || !strings.Contains(out, "generation 1,") {
		t.Errorf("startup probe %q: %v: %s", p.Exec.Command, err, out)
	}
	if code, body, err := e2e.HTTPGet(ctx, tp.Node, liveURL); err != nil || code != http.StatusOK {
		t.Errorf("liveness probe %s: %d %q %v", liveURL, code, body, err)
	}
	metricsURL := strings.Replace(readyURL, "/readyz", "/metrics", 1)
	_, metrics, err := e2e.HTTPGet(ctx, tp.Node, metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	info := grep(metrics, "ip_masq_agent_datapath_info{")
	for _, want := range []string{fmt.Sprintf("backend=%q", backend.Info.Backend), fmt.Sprintf("attach_mode=%q", backend.Info.AttachMode)} {
		if !strings.Contains(info, want) {
			t.Errorf("datapath info %q does not say %s", info, want)
		}
	}
	if want := fmt.Sprintf("version=%q", img.Options.Version); !strings.Contains(grep(metrics, "ip_masq_agent_build_info"), want) {
		t.Errorf("build info %s, want %s", grep(metrics, "ip_masq_agent_build_info"), want)
	}
	logs, err := podman.Logs(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if seccomp == "" {
		fallback := grep(logs, "the BPF datapath cannot run here; using "+backend.Info.Backend)
		for _, want := range []string{"seccomp blocked bpf(2)", "EPERM", "deploy/seccomp/ip-masq-agent.json"} {
			if !strings.Contains(fallback, want) {
				t.Errorf("the fallback to %s does not say %q:\n%s", backend.Info.Backend, want, fallback)
			}
		}
	}

	// What it installed is the policy of the base ConfigMap, and real traffic shows it.
	backend.Verify(ctx, t, env)
	traffic := func(want map[string]e2e.Want) {
		t.Helper()
		for dst, w := range want {
			for _, proto := range []string{"tcp", "udp"} {
				got, seen, err := env.Observe(ctx, proto, netip.MustParseAddr(dst))
				if err != nil {
					t.Fatal(err)
				}
				if got != w {
					t.Errorf("%s to %s: the external host saw %s (%v), want %v", proto, dst, seen, got, w)
				}
			}
		}
	}
	traffic(map[string]e2e.Want{"8.8.8.8": e2e.Masq, "192.0.2.1": e2e.Masq, "10.1.2.3": e2e.Keep, "172.16.5.5": e2e.Keep})

	// SIGTERM within the grace period: a clean exit that leaves the datapath in place.
	if _, err := podman.Run(ctx, "stop", name); err != nil {
		t.Fatal(err)
	}
	if code, err := podman.Inspect(ctx, name, "{{.State.ExitCode}}"); err != nil || code != "0" {
		t.Errorf("exit code after SIGTERM: %s %v", code, err)
	}
	if logs, err = podman.Logs(ctx, name); err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(logs, "shutting down; the datapath stays in place")
	if !ok {
		t.Errorf("no shutdown in the log:\n%s", logs)
	}
	if s := grep(after, "level=WARN") + grep(after, "level=ERROR"); s != "" {
		t.Errorf("the shutdown logged:\n%s", s)
	}
	traffic(map[string]e2e.Want{"8.8.8.8": e2e.Masq})

	// The cleanup DaemonSet's container: everything goes, and the pod keeps its address.
	cspec := cleanupDS.Spec.Template.Spec
	cc := cspec.InitContainers[0]
	cname := name + "-cleanup"
	cargs, err := PodmanArgs(cspec, cc, Run{Name: cname, Image: cc.Image, NetNS: tp.Node, Seccomp: cleanupSeccomp, Sources: src})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := podman.Run(ctx, cargs...); err != nil {
		t.Fatal(err)
	}
	out, err := podman.Run(ctx, "start", "--attach", cname)
	t.Logf("cleanup: %s", strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("cleanup: %v", err)
	}
	if _, err := podman.Run(ctx, "rm", cname); err != nil {
		t.Error(err)
	}
	if cleanupSeccomp == "" && backend.Info.Backend == bpfbackend.Name {
		if want := "2 tcx link pins removed"; !strings.Contains(out, want) || !strings.Contains(out, "seccomp blocked bpf(2)") {
			t.Errorf("cleanup without bpf(2) does not say %q and why", want)
		}
		// The kernel frees a link whose last reference (its pin) went in a work item of its
		// own: the programs leave the uplink shortly after.
		_ = testutil.Poll(5*time.Second, 10*time.Millisecond, func() error {
			if progs, _ := env.UplinkPrograms(t); len(progs) != 0 {
				return testutil.NotYet("programs on the uplink: %v", progs)
			}
			return nil
		}) // what is left, Gone below reports
	}
	e2e.BPFBackend(tc.ModeTCX).Gone(ctx, t, env)
	e2e.IptablesBackend(iptables.ModeNFT).Gone(ctx, t, env)
	e2e.NftablesBackend().Gone(ctx, t, env)
	traffic(map[string]e2e.Want{"8.8.8.8": e2e.Keep})
	t.Logf("ready %v after the start; the whole run took %v", ready.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// checkNetns fails the test unless the process is in the named namespace (and so not in the
// host's): before anything runs in the container.
func checkNetns(t *testing.T, pid, netns string) {
	t.Helper()
	ino := func(path string) uint64 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	got, want := ino("/proc/"+pid+"/ns/net"), ino("/run/netns/"+netns)
	if got != want || got == hostNetns {
		t.Fatalf("the container's network namespace is %d, the node's %d (the host's %d): stopping before it runs", got, want, hostNetns)
	}
}

// waitReady polls the readiness probe until it answers 200, while the container runs.
func waitReady(ctx context.Context, t *testing.T, name, netns, url string) {
	t.Helper()
	if err := testutil.PollContext(ctx, 50*time.Millisecond, func() error {
		code, _, err := e2e.HTTPGet(ctx, netns, url)
		if err == nil && code == http.StatusOK {
			return nil
		}
		if running, ierr := podman.Inspect(ctx, name, "{{.State.Running}}"); ierr != nil || running != "true" {
			return fmt.Errorf("the container stopped before it was ready (%s %v)", running, ierr)
		}
		return testutil.NotYet("ready (last: %d %v)", code, err)
	}); err != nil {
		t.Fatal(err)
	}
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
