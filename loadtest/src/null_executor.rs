//! An executor that does no VM work: children are "ready" the moment they are asked for, exec
//! prints nothing and exits 0. Put behind the control plane it isolates the control plane's
//! own cost per request (gRPC in and out, auth, audit, SQLite, scheduling) from the
//! executor's: that is what the control-plane overhead figure measures. Never a stand-in for
//! a real executor when sandboxes themselves are measured.

use std::net::SocketAddr;
use std::pin::Pin;

use futures::Stream;
use tine_proto::executor::v1 as xpb;
use tine_proto::executor::v1::executor_server::{Executor, ExecutorServer};
use tine_proto::v1 as pb;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone, Default)]
pub struct NullExecutor;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn unsupported<T>(what: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "the null executor does no {what}"
    )))
}

#[tonic::async_trait]
impl Executor for NullExecutor {
    type SpawnStream = ReceiverStream<Result<xpb::SpawnEvent, Status>>;
    type ExecStream = BoxStream<pb::ExecEvent>;
    type ReadFileStream = BoxStream<pb::FileChunk>;

    async fn info(
        &self,
        _: Request<xpb::InfoRequest>,
    ) -> Result<Response<pb::ExecutorReport>, Status> {
        Ok(Response::new(pb::ExecutorReport::default()))
    }
    async fn create_snapshot(
        &self,
        _: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        unsupported("snapshots")
    }
    async fn branch(
        &self,
        _: Request<pb::BranchRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        unsupported("branches")
    }
    async fn expose_port(
        &self,
        _: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::ExposePortResponse>, Status> {
        unsupported("exposed ports")
    }
    async fn usage(
        &self,
        _: Request<xpb::UsageRequest>,
    ) -> Result<Response<pb::SandboxUsage>, Status> {
        unsupported("usage")
    }
    type StartBranchStream = BoxStream<xpb::BranchEvent>;
    async fn start_branch(
        &self,
        _: Request<pb::BranchRequest>,
    ) -> Result<Response<Self::StartBranchStream>, Status> {
        unsupported("branches")
    }
    async fn delete_snapshot(
        &self,
        _: Request<xpb::DeleteSnapshotRequest>,
    ) -> Result<Response<xpb::DeleteSnapshotResponse>, Status> {
        Ok(Response::new(xpb::DeleteSnapshotResponse {
            existed: false,
        }))
    }
    async fn spawn(
        &self,
        req: Request<xpb::SpawnRequest>,
    ) -> Result<Response<Self::SpawnStream>, Status> {
        let ids = req.into_inner().ids;
        let (tx, rx) = tokio::sync::mpsc::channel(ids.len() + 1);
        for id in ids {
            let _ = tx.try_send(Ok(xpb::SpawnEvent {
                id,
                result: Some(xpb::spawn_event::Result::ReadyUs(0)),
            }));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }
    async fn kill(
        &self,
        _: Request<xpb::KillRequest>,
    ) -> Result<Response<xpb::KillResponse>, Status> {
        Ok(Response::new(xpb::KillResponse { existed: true }))
    }
    async fn exec(
        &self,
        _: Request<pb::ExecRequest>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let exit = pb::ExecEvent {
            event: Some(pb::exec_event::Event::Exit(pb::ExitStatus {
                how: Some(pb::exit_status::How::Code(0)),
                timed_out: false,
            })),
        };
        Ok(Response::new(Box::pin(futures::stream::iter([Ok(exit)]))))
    }
    async fn eval(
        &self,
        _: Request<pb::EvalRequest>,
    ) -> Result<Response<pb::EvalResponse>, Status> {
        Ok(Response::new(pb::EvalResponse::default()))
    }
    async fn read_file(
        &self,
        _: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        unsupported("files")
    }
    async fn write_file(
        &self,
        _: Request<Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        unsupported("files")
    }
}

/// Serve a null executor on a loopback port (no auth: loopback only).
pub async fn serve() -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExecutorServer::new(NullExecutor))
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            ),
    );
    Ok(addr)
}
