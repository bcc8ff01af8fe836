package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
)

// The references Kubernetes' e2e tests (v1.34.4, test/utils/image/manifest.go) run their pods
// from. The cluster has no registry: BuildE2EImages builds them here under these names, and
// pods find them imported (the tests pull only if not present).
const (
	AgnhostRef              = "registry.k8s.io/e2e-test-images/agnhost:2.56"
	BusyBoxRef              = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
	JessieDnsutilsRef       = "registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7"
	NginxRef                = "registry.k8s.io/e2e-test-images/nginx:1.14-4"
	RegressionIssue74839Ref = "registry.k8s.io/e2e-test-images/regression-issue-74839:1.2"
	// E2EPauseRef is the pause the tests name; the cluster's sandboxes run PauseRef, the same
	// program.
	E2EPauseRef = "registry.k8s.io/pause:3.10.1"
)

// e2eToolbox is the Debian root filesystem under the images of the e2e tests' pods: what the
// sig-network tests run in them (kubectl exec ... /bin/sh -x -c) over Debian's essential set
// (dash as sh, coreutils, grep, getent, hostname): curl, nc in netcat-openbsd's syntax, wget,
// dig and nslookup, ip and ss, iperf. Upstream's agnhost is Alpine with the same tools.
var e2eToolbox = image.Spec{
	Suite:    "bookworm",
	Packages: []string{"bash", "curl", "netcat-openbsd", "wget", "bind9-dnsutils", "iproute2", "iperf"},
	Remove:   []string{"/usr/share/doc", "/usr/share/man", "/usr/share/info", "/usr/share/locale", "/usr/share/lintian", "/var/cache/debconf/*-old"},
}

// e2eToolboxImages are the images made of the toolbox with agnhost's layer on top: agnhost as
// upstream's (entrypoint /agnhost, arguments pause), and in place of busybox, jessie-dnsutils
// and nginx the same files, since the tests need only their shell and tools (busybox's sh, nc
// and sleep; jessie-dnsutils' dig and getent) or, of nginx, a server that keeps running (agnhost
// serving HTTP on nginx's port 80).
var e2eToolboxImages = []struct {
	ref, entrypoint string
	cmd             []string
}{
	{AgnhostRef, "/agnhost", []string{"pause"}},
	{BusyBoxRef, "", []string{"sh"}},
	{JessieDnsutilsRef, "", []string{"sh"}},
	{NginxRef, "/agnhost", []string{"netexec", "--http-port=80", "--udp-port=-1"}},
}

// E2EImages are the references of the archives BuildE2EImages returns, in its order.
func E2EImages() []string {
	var refs []string
	for _, t := range e2eToolboxImages {
		refs = append(refs, t.ref)
	}
	return append(refs, RegressionIssue74839Ref, E2EPauseRef)
}

// E2EBins is what `make k8s-e2e` builds beside the components (in Binaries' directory).
type E2EBins struct {
	Test       string // the sig-network e2e test binary
	Ginkgo     string // ginkgo's command, which runs Test in parallel processes
	Agnhost    string
	Regression string // regression-issue-74839
	// Modfile is the go.mod of the tools module that built them, for the go commands ginkgo
	// runs to check its version against the tests'.
	Modfile string
}

// E2EBinaries finds what `make k8s-e2e` builds.
func E2EBinaries() (E2EBins, error) {
	dir, err := findBinaries("run make k8s-e2e", "e2e-network.test", "ginkgo", "agnhost", "regression-issue-74839")
	if err != nil {
		return E2EBins{}, err
	}
	root, err := RepoRoot()
	if err != nil {
		return E2EBins{}, err
	}
	return E2EBins{
		Test:       filepath.Join(dir, "e2e-network.test"),
		Ginkgo:     filepath.Join(dir, "ginkgo"),
		Agnhost:    filepath.Join(dir, "agnhost"),
		Regression: filepath.Join(dir, "regression-issue-74839"),
		Modfile:    filepath.Join(root, toolsModule),
	}, nil
}

// e2eEpoch is every timestamp of the images: they are the same bytes from the same inputs.
var e2eEpoch = time.Unix(0, 0)

// BuildE2EImages builds the images of the e2e tests' pods as OCI archives in dir, for Import,
// named as E2EImages lists them: the toolbox root filesystem is made once (mmdebstrap, a
// minute or more) and packed under each of e2eToolboxImages with agnhost's layer; agnhost's and
// regression-issue-74839's binaries are make k8s-e2e's; the pause program is BuildPause's.
func BuildE2EImages(ctx context.Context, dir string) ([]string, error) {
	bins, err := E2EBinaries()
	if err != nil {
		return nil, err
	}
	base := filepath.Join(dir, "toolbox-rootfs.tar")
	log := filepath.Join(dir, "toolbox-mmdebstrap.log")
	if err := buildToolbox(ctx, base, log); err != nil {
		return nil, err
	}
	top := filepath.Join(dir, "agnhost-layer.tar")
	if err := agnhostLayer(ctx, top, bins.Agnhost); err != nil {
		return nil, err
	}
	var archives []string
	for _, t := range e2eToolboxImages {
		spec := e2eToolbox
		spec.Binary, spec.Cmd = t.entrypoint, t.cmd
		out, err := packE2E(dir, t.ref, spec, base, top)
		if err != nil {
			return nil, err
		}
		archives = append(archives, out)
	}
	rootfs := filepath.Join(dir, "regression-issue-74839-rootfs.tar")
	if err := image.WriteLayer(rootfs, e2eEpoch, []image.Entry{{Path: "/regression-issue-74839", Source: bins.Regression, Mode: 0o755}}); err != nil {
		return nil, err
	}
	out, err := packE2E(dir, RegressionIssue74839Ref, image.Spec{Suite: "none", Binary: "/regression-issue-74839"}, rootfs)
	if err != nil {
		return nil, err
	}
	archives = append(archives, out)
	pause, err := e2ePause(ctx, dir)
	if err != nil {
		return nil, err
	}
	return append(archives, pause), nil
}

// buildToolbox makes the toolbox root filesystem as a tar at out, mmdebstrap's output in log.
func buildToolbox(ctx context.Context, out, log string) error {
	f, err := os.Create(log)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := image.RootFS(ctx, image.Options{Spec: e2eToolbox, Epoch: e2eEpoch, Log: f}, out); err != nil {
		return fmt.Errorf("the e2e images' root filesystem (log: %s): %w", log, err)
	}
	return f.Close()
}

// agnhostLayer writes the files upstream's agnhost image adds to its base, as a layer: the
// binary and its agnhost-2 link (the entrypoint tests), porter's TLS certificate and key
// (served on porter's TLS ports, read from the module cache) and netexec's /uploads.
func agnhostLayer(ctx context.Context, out, agnhost string) error {
	porter, err := agnhostSource(ctx, "porter")
	if err != nil {
		return err
	}
	// Upstream's image carries CoreDNS too: "DNS should support configurable pod resolv.conf"
	// runs it as a pod's DNS server (its hosts and log plugins, which make coredns's has).
	coredns, err := CoreDNSBinary()
	if err != nil {
		return err
	}
	return image.WriteLayer(out, e2eEpoch, []image.Entry{
		{Path: "/agnhost", Source: agnhost, Mode: 0o755},
		{Path: "/agnhost-2", Link: "agnhost"},
		{Path: "/coredns", Source: coredns, Mode: 0o755},
		{Path: "/localhost.crt", Source: filepath.Join(porter, "localhost.crt")},
		{Path: "/localhost.key", Source: filepath.Join(porter, "localhost.key")},
		{Path: "/uploads"},
	})
}

// agnhostSource is the directory sub of agnhost's source in the tools module's
// k8s.io/kubernetes (the module cache, where make k8s-e2e's build left it).
func agnhostSource(ctx context.Context, sub string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes")
	cmd.Dir = filepath.Join(root, filepath.Dir(toolsModule))
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("find k8s.io/kubernetes in the tools module (run make k8s-e2e): %w", err)
	}
	dir := filepath.Join(strings.TrimSpace(string(out)), "test", "images", "agnhost", sub)
	if _, err := os.Stat(dir); err != nil {
		return "", fmt.Errorf("agnhost's %s (run make k8s-e2e): %w", sub, err)
	}
	return dir, nil
}

// packE2E packs the layers as the image ref in dir, in an archive named after the image.
func packE2E(dir, ref string, spec image.Spec, layers ...string) (string, error) {
	out := filepath.Join(dir, archiveName(ref))
	_, tag, _ := strings.Cut(ref[strings.LastIndex(ref, "/")+1:], ":")
	if _, err := image.Pack(image.Options{Spec: spec, Version: tag, Reference: ref, Epoch: e2eEpoch, Output: out}, layers...); err != nil {
		return "", fmt.Errorf("pack %s: %w", ref, err)
	}
	return out, nil
}

// archiveName is the file name of ref's archive: its last path element, ":" as "-".
func archiveName(ref string) string {
	return strings.ReplaceAll(ref[strings.LastIndex(ref, "/")+1:], ":", "-") + ".tar"
}

// e2ePause is BuildPause's image renamed E2EPauseRef.
func e2ePause(ctx context.Context, dir string) (string, error) {
	pdir := filepath.Join(dir, "pause")
	if err := os.MkdirAll(pdir, 0o755); err != nil {
		return "", err
	}
	pause, err := BuildPause(ctx, pdir)
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, archiveName(E2EPauseRef))
	return out, image.Retag(pause, out, E2EPauseRef)
}
