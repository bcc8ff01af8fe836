package cluster_test

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	v1 "github.com/opencontainers/image-spec/specs-go/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ociArchive is an OCI archive's image: its reference, configuration and layers (uncompressed
// tars), read whole.
type ociArchive struct {
	ref    string
	config v1.Image
	layers [][]byte
}

func readArchive(t *testing.T, name string) ociArchive {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if files[h.Name], err = io.ReadAll(tr); err != nil {
			t.Fatal(err)
		}
	}
	blob := func(d v1.Descriptor) []byte {
		return files[path.Join("blobs", d.Digest.Algorithm().String(), d.Digest.Encoded())]
	}
	var index v1.Index
	var manifest v1.Manifest
	var a ociArchive
	if err := json.Unmarshal(files["index.json"], &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("%s: index %s: %v", name, files["index.json"], err)
	}
	if err := json.Unmarshal(blob(index.Manifests[0]), &manifest); err != nil {
		t.Fatalf("%s: manifest: %v", name, err)
	}
	if err := json.Unmarshal(blob(manifest.Config), &a.config); err != nil {
		t.Fatalf("%s: config: %v", name, err)
	}
	a.ref = index.Manifests[0].Annotations[v1.AnnotationRefName]
	for _, l := range manifest.Layers {
		a.layers = append(a.layers, blob(l))
	}
	return a
}

// extract lays the image's layers into dir (tar keeps their modes and links).
func (a ociArchive) extract(t *testing.T, dir string) {
	t.Helper()
	for i, l := range a.layers {
		cmd := exec.Command("tar", "-C", dir, "-xpf", "-")
		cmd.Stdin = bytes.NewReader(l)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: layer %d: %v: %s", a.ref, i, err, out)
		}
	}
}

// TestE2EImages builds the images of Kubernetes' e2e tests (BuildE2EImages), checks that each
// archive is named as the e2e binary asks, and that agnhost's root filesystem runs agnhost and
// holds the tools the tests run in it; then it imports them into a cluster and runs every one
// in a pod, reaching agnhost's and nginx's servers from outside.
func TestE2EImages(t *testing.T) {
	testutil.RequirePrivileged(t, "mmdebstrap", "chroot", "tar")
	bins, err := cluster.E2EBinaries()
	if err != nil {
		testutil.Unavailable(t, "%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	dir := t.TempDir()
	start := time.Now()
	archives, err := cluster.BuildE2EImages(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built in %v", time.Since(start).Round(time.Second))
	for _, a := range archives {
		if st, err := os.Stat(a); err == nil {
			t.Logf("%s: %.1f MB", filepath.Base(a), float64(st.Size())/1e6)
		}
	}

	t.Run("references", func(t *testing.T) {
		out, err := exec.CommandContext(ctx, bins.Test, "--list-images").Output()
		if err != nil {
			t.Fatalf("%s --list-images: %v", bins.Test, err)
		}
		asked := strings.Fields(string(out))
		want := cluster.E2EImages()
		if len(archives) != len(want) {
			t.Fatalf("%d archives, want %d (%q)", len(archives), len(want), want)
		}
		for i, name := range archives {
			got := readArchive(t, name).ref
			if got != want[i] {
				t.Errorf("%s is %q, want %q", name, got, want[i])
			}
			if !slices.Contains(asked, got) {
				t.Errorf("%q is not an image the e2e binary asks for (--list-images: %q)", got, asked)
			}
		}
	})

	t.Run("agnhost", func(t *testing.T) {
		a := readArchive(t, archives[slices.Index(cluster.E2EImages(), cluster.AgnhostRef)])
		if c := a.config.Config; !slices.Equal(c.Entrypoint, []string{"/agnhost"}) || !slices.Equal(c.Cmd, []string{"pause"}) {
			t.Errorf("entrypoint %q cmd %q, want [/agnhost] [pause]", c.Entrypoint, c.Cmd)
		}
		root := t.TempDir()
		a.extract(t, root)
		for _, f := range []string{"localhost.crt", "localhost.key", "uploads"} {
			if _, err := os.Stat(filepath.Join(root, f)); err != nil {
				t.Error(err)
			}
		}
		out, err := exec.CommandContext(ctx, "chroot", root, "/agnhost-2", "--help").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "netexec") {
			t.Errorf("agnhost-2 --help: %v:\n%s", err, out)
		}
		if out, err := exec.CommandContext(ctx, "chroot", root, "/coredns", "-plugins").CombinedOutput(); err != nil || !slices.Contains(strings.Fields(string(out)), "hosts") || !slices.Contains(strings.Fields(string(out)), "log") {
			t.Errorf("coredns -plugins: %v:\n%s", err, out)
		}
		if out, err := exec.CommandContext(ctx, "chroot", root, "/bin/sh", "-c", toolsCheck).CombinedOutput(); err != nil {
			t.Errorf("the tools: %v:\n%s", err, out)
		}
	})

	t.Run("cluster", func(t *testing.T) {
		c := cluster.Start(t, cluster.ClusterOptions{Images: archives})
		pod := e2eImagesPod()
		if _, err := c.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		p, err := c.WaitPodRunning(ctx, "default", pod.Name)
		if err != nil {
			t.Fatal(err)
		}
		podIP := netip.MustParseAddr(p.Status.PodIP)
		client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: cluster.Dialer("/run/netns/"+c.Outside, nil)}}
		get := func(port uint16, path string) string {
			t.Helper()
			resp, err := client.Get("http://" + netip.AddrPortFrom(podIP, port).String() + path)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("GET :%d%s: %s %v: %s", port, path, resp.Status, err, body)
			}
			return strings.TrimSpace(string(body))
		}
		if ip, _, _ := net.SplitHostPort(get(8080, "/clientip")); ip != cluster.OutsideAddress.String() {
			t.Errorf("agnhost netexec saw the client as %q, want %s", ip, cluster.OutsideAddress)
		}
		if host := get(80, "/hostname"); host != pod.Name {
			t.Errorf("nginx's /hostname is %q, want %q", host, pod.Name)
		}
		conn, err := cluster.Dialer("/run/netns/"+c.Outside, nil)(ctx, "tcp", netip.AddrPortFrom(podIP, 9000).String())
		if err != nil {
			t.Errorf("regression-issue-74839's server: %v", err)
		} else {
			conn.Close()
		}
		// The way the framework runs commands in its pods.
		for _, ctr := range []string{"agnhost", "jessie-dnsutils", "busybox"} {
			if out, err := c.Kubectl(ctx, "exec", pod.Name, "-c", ctr, "--", "/bin/sh", "-x", "-c", toolsCheck); err != nil {
				t.Errorf("kubectl exec -c %s: %v:\n%s", ctr, err, out)
			}
		}
	})
}

// toolsCheck fails unless every command the sig-network tests run in agnhost (and in the
// toolbox images) is there.
const toolsCheck = `set -e; for c in sh bash curl wget nc dig nslookup ip ss iperf getent hostname seq sleep grep cat date test; do command -v $c; done`

// e2eImagesPod runs every e2e image as the tests do (pulled only if not present): agnhost's
// netexec, nginx, busybox and jessie-dnsutils idle, regression-issue-74839's server, pause.
func e2eImagesPod() *corev1.Pod {
	idle := []string{"sh", "-c", "sleep 3600"}
	ctr := func(name, ref string, command, args []string) corev1.Container {
		return corev1.Container{Name: name, Image: ref, ImagePullPolicy: corev1.PullIfNotPresent, Command: command, Args: args}
	}
	regression := ctr("regression-issue-74839", cluster.RegressionIssue74839Ref, nil, nil)
	regression.Env = []corev1.EnvVar{{Name: "POD_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}}}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "e2e-images"},
		Spec: corev1.PodSpec{
			NodeName:                      cluster.NodeName,
			TerminationGracePeriodSeconds: new(int64),
			AutomountServiceAccountToken:  new(bool),
			Containers: []corev1.Container{
				ctr("agnhost", cluster.AgnhostRef, nil, []string{"netexec", "--http-port=8080", "--udp-port=8081"}),
				ctr("nginx", cluster.NginxRef, nil, nil),
				ctr("busybox", cluster.BusyBoxRef, idle, nil),
				ctr("jessie-dnsutils", cluster.JessieDnsutilsRef, idle, nil),
				regression,
				ctr("pause", cluster.E2EPauseRef, nil, nil),
			},
		},
	}
}
